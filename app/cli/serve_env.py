"""The environment ``loraplex serve`` starts Ray Serve with: its data path.

``haproxy`` (the default): Ray Serve's high-throughput mode — HAProxy (a C load balancer) instead
of the Python HTTP proxy in front of the gateway replicas, direct gRPC between the gateway and
the engine replicas, user code on the replica's own event loop (``RAY_SERVE_ENABLE_HA_PROXY``,
``RAY_SERVE_THROUGHPUT_OPTIMIZED``). Each token a stream delivers then crosses one Python process
less. HAProxy's config file and admin socket go under a folder of this run (Serve's defaults are
fixed paths that two stacks on one machine would share), so do its metrics and stats ports (free
ports from ``app.cli.free_ports``, where no Ray process picks its own, instead of Serve's fixed
ones; HAProxy binds them on every interface: they carry replica names and request counts, no
tenant or adapter), and so do the ports of the fallback proxy that
HAProxy sends requests to while no ingress replica is ready (Serve's fixed 8500/9500: a second
stack on the machine, still starting, would hand its requests to the first stack's application).
The draining period Serve keeps a stopping ingress replica for an external load balancer is
short (HAProxy is Serve's own). HAProxy's buffer (``tune.bufsize``, Serve's default 16 KiB)
holds the request line and headers: it is sized above the gateways' ``max_header_bytes`` so that
headers the gateway allows reach it, and those just above its limit get its JSON 431 (HAProxy 2.8
answers requests whose headers overflow its buffer with its own HTML 400 and no error file).
``python``: Serve's defaults (the Python proxy, Ray's own RPC between replicas). Variables
already set in the environment win over both.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Literal

from app.cli.free_ports import free_ports

Proxy = Literal["haproxy", "python"]
PROXIES: tuple[Proxy, ...] = ("haproxy", "python")
DRAINING_PERIOD_S = "5"
HEADER_HEADROOM = 16 * 2**10
"""Buffer bytes above the gateways' header limit: the request line, HAProxy's rewrite reserve
(``tune.maxrewrite``, 1 KiB), line ends, and headers just over the limit."""


def haproxy_bufsize(max_header_bytes: int) -> int:
    """HAProxy's ``tune.bufsize`` for gateways that allow ``max_header_bytes`` of headers."""
    return max_header_bytes + HEADER_HEADROOM


def serve_env(env: dict[str, str], proxy: Proxy, max_header_bytes: int) -> tuple[dict[str, str], Path | None]:
    """``env`` with the data-path variables of ``proxy`` added where not already set, and the
    run folder made for HAProxy's files (the caller removes it; None when none was made).
    ``max_header_bytes``: the largest header limit of the config's gateways."""
    out = dict(env)
    run_dir = None
    out.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # single node: Ray binds loopback
    if proxy == "haproxy":
        run_dir = Path(tempfile.mkdtemp(prefix="lpx-haproxy-"))
        out.setdefault("RAY_SERVE_ENABLE_HA_PROXY", "1")
        out.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
        out.setdefault("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", str(run_dir / "haproxy.cfg"))
        out.setdefault("RAY_SERVE_HAPROXY_SOCKET_PATH", str(run_dir / "admin.sock"))
        ports = free_ports(4)
        for name, port in zip(("RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_HAPROXY_STATS_PORT",
                               "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT"), ports):
            out.setdefault(name, str(port))
        out.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", DRAINING_PERIOD_S)
        out.setdefault("RAY_SERVE_HAPROXY_TUNE_BUFSIZE", str(haproxy_bufsize(max_header_bytes)))
    return out, run_dir
