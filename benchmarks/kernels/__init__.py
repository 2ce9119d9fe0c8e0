"""Kernel-level benchmarks and tuners (GPU: CUDA-graph timing; CPU: the PyTorch path)."""
