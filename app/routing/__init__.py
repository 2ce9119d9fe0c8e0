"""Adapter-affinity placement: the pure ranking policy and the Ray Serve request router that feeds it."""
