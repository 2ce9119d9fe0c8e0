"""A discrete-event model of loraplex serving many tenants (``benchmarks.packing``)."""
