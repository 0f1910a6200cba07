"""vLLM 0.26 glue for DDTree (work in progress: see docs/integration.md).

Only engine-facing building blocks live here so far; nothing registers with vLLM yet.
"""
