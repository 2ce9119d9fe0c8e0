"""Kernels against the PyTorch reference (Triton under the interpreter on CPU)."""
