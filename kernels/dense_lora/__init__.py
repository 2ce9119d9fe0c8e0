"""The dense (attention / projection) LoRA Triton ops: token groups by slot, shrink/expand kernels, tuned configs, and the per-layer driver."""
