"""Everything that touches vLLM internals: the supported-version table, the patch mechanism, the general plugin, and the CUDA and CPU integrations."""
