"""Benchmarks: each script prints a side-by-side table; figures go to benchmarks/RESULTS.md."""
