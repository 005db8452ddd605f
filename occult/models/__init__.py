"""Single-device MoE models: the tiny OLMoE, checkpoint import, upcycling of a dense GGUF model."""
