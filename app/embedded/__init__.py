"""The embedded default: a tiny Qwen3-MoE, demo adapters and tenants built locally (no downloads)."""
