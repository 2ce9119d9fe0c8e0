"""The CPU MoE-LoRA path (PyTorch), batched by (expert, adapter): what vLLM-CPU lacks."""
