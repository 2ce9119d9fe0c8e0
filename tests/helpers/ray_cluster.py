"""A private local Ray cluster for tests that need real Ray actors (not a Serve stack)."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager

from tests.helpers.environment import environment
from tests.helpers.paths import pythonpath_with_repo


@contextmanager
def local_ray(num_cpus: int = 1):
    """``ray.init`` of a fresh one-node cluster in its own temp dir (loopback, no dashboard), its
    workers importing this checkout; shut down and removed on exit."""
    import ray

    tmp = tempfile.mkdtemp(prefix="lpx-ray-", dir="/tmp")  # short: Ray's socket paths stay < 108 bytes
    env = {"PYTHONPATH": pythonpath_with_repo(os.environ.get("PYTHONPATH")),
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    try:
        with environment(env):
            try:
                ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=tmp, namespace="tests",
                         configure_logging=False)
                yield ray
            finally:
                ray.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
