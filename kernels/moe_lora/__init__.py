"""The MoE-LoRA Triton ops: row sort into (adapter, expert) blocks, shrink/expand kernels, the tiny-batch fused launch, GPT-OSS's folded activation, tuned configs, and the per-layer driver."""
