"""Routing algorithms on CPU: co-activation profiling, expert placement, collaboration pruning, variants."""
