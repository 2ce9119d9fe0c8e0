"""Benchmark scripts keep working (tiniest settings)."""
