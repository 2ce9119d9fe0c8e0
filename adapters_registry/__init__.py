"""loraplex."""
