"""Rollout engines behind one interface: the built-in torch engine (CPU) and the vLLM adapter (GPU)."""
