"""Expert-parallel runtime: BRIM dispatch/combine with dedup and per-expert modes."""
