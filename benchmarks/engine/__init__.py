"""Engine-level benchmarks: vLLM AsyncLLM in process, with and without loraplex's kernels."""
