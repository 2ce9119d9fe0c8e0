"""The vLLM integrations (CPU engine end to end; CUDA patches on a GPU)."""
