"""Metrics and request logs of the serving path, per tenant, adapter and replica.

Every loraplex series is recorded through Ray's metrics agent (``ray.util.metrics``), which
exports the series of every process of a node on that node's metrics export port; scraping that
port on every node (the chart's ServiceMonitor) is the one cluster-wide view. The gateway's
public port serves no metrics.

- ``config``: the Serve config's ``observability`` section (label caps, request logs)
- ``labels``: bounded label values (the rest in ``other``)
- ``series``: the table of series (names, help, tags, buckets)
- ``instruments``: counters, histograms and gauges over Ray's metrics or a local registry
- ``token_timing``: time to first token and inter-token latency from vLLM's output progress
- ``gateway``, ``engine``, ``registry_metrics``: what each component records per request or event
- ``targets``: the cluster's scrape targets (Prometheus HTTP service discovery)
"""
