"""The engine replica: vLLM AsyncLLM with LoRA, vLLM's OpenAI serving layer, the slot table."""
