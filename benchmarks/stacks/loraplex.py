"""loraplex itself: ``python -m app.cli.main serve CONFIG`` with its own ``LORAPLEX_HOME``.

The Serve config is derived from a given one (default ``deploy/config.yaml``) with another port
and ``args`` merged with ``args_update`` (``tests.helpers.stack.write_config``), and the
engine-argument dict of the other servers mapped onto ``engine`` (fields of ``app.config.EngineConfig`` by name, any other vLLM
argument into ``engine.extra_engine_args``; LoRA is always on). The home is initialised when
needed (embedded model, demo adapters, demo tenants); adapters given in ``publish`` are pushed
into its store for ``tenant``; every request carries the key of the adapter's owner (demo keys).
``checkout``: the serving stack runs the code of another checkout of the repository (its folder
first on ``PYTHONPATH`` and the working directory), e.g. ``git archive main`` unpacked, so a
change is measured against its baseline in one run; configs, home and adapters stay this one's.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import yaml

from benchmarks.loadgen.spec import TargetSpec
from benchmarks.stacks.process import Launch, Server, ray_env
from tests.helpers.paths import REPO
from tests.helpers.stack import write_config

DEFAULT_CONFIG = REPO / "deploy" / "config.yaml"


def engine_section(engine_args: dict[str, Any]) -> dict[str, Any]:
    """vLLM engine arguments as loraplex's ``engine`` config: its own fields by name, the rest
    in ``extra_engine_args`` (``enable_lora`` dropped: always on)."""
    from app.config import EngineConfig

    own = set(EngineConfig.model_fields) - {"extra_engine_args"}
    section: dict[str, Any] = {k: v for k, v in engine_args.items() if k in own}
    extra = {k: v for k, v in engine_args.items() if k not in own and k != "enable_lora"}
    if extra:
        section["extra_engine_args"] = extra
    return section


class LoraplexServer(Server):
    """``with LoraplexServer(workdir, home, engine_args, adapters=[...], publish={...}) as target``.

    ``adapters``: adapter ids already in the store that the load addresses (probed at start);
    ``publish``: PEFT folders pushed into the store first (by id, owner ``tenant``), addressed too."""

    kind = "loraplex"

    def __init__(self, workdir: Path, home: Path, engine_args: dict[str, Any] | None = None,
                 adapters: list[str] | None = None, publish: dict[str, Path] | None = None,
                 tenant: str = "acme", config: Path = DEFAULT_CONFIG, args_update: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None, name: str | None = None, checkout: Path | None = None,
                 proxy: str | None = None) -> None:
        super().__init__(workdir, name)
        self.proxy = proxy  # `loraplex serve --proxy` (None: its default)
        self.checkout = Path(checkout).resolve() if checkout is not None else None
        self.home, self.config_source, self.tenant = Path(home), Path(config), tenant
        self.engine_args = dict(engine_args or {})
        self.publish = dict(publish or {})
        self.adapters = list(dict.fromkeys([*(adapters or []), *self.publish]))
        self.args_update = dict(args_update or {})
        self.extra_env = dict(env or {})
        self.keys: dict[str, str] = {}
        self.served_model_name = "loraplex-base"

    def _store(self, args: dict[str, Any]):
        from adapters_registry.stores import open_store

        return open_store(args.get("store_uri") or (self.home / "store").resolve().as_uri(), args.get("s3_endpoint_url"))

    def _publish_and_key(self, args: dict[str, Any]) -> None:
        """Pushes ``publish`` into the store; the key of each addressed adapter's owner."""
        from adapters_registry.manifest import BaseModelInfo
        from app.embedded.setup import demo_keys, model_dir

        store = self._store(args)
        if self.publish:
            model = args.get("engine", {}).get("model", "embedded")
            base = BaseModelInfo.from_model_dir(model_dir(self.home) if model == "embedded" else Path(model))
            for adapter_id, folder in self.publish.items():
                store.publish(Path(folder), adapter_id, self.tenant, base)
        keys = demo_keys(self.home)
        self.keys = {a: keys[store.get(a).owner_tenant] for a in self.adapters}
        self.keys[self.served_model_name] = keys[self.tenant]

    def prepare(self) -> Launch:
        from app.embedded.setup import init

        init(self.home, progress=False)
        update = dict(self.args_update)
        if self.engine_args:
            update["engine"] = {**engine_section(self.engine_args), **update.get("engine", {})}
        config = self.workdir / f"{self.name}-serve-config.yaml"
        cfg = yaml.safe_load(write_config(config, self.port, update, self.config_source).read_text())
        args = cfg["applications"][0]["args"]
        self.served_model_name = args.get("engine", {}).get("served_model_name", self.served_model_name)
        self._publish_and_key(args)
        env, ray_tmp = ray_env(self.home, self.extra_env)
        cwd = REPO
        if self.checkout is not None:
            env["PYTHONPATH"] = f"{self.checkout}{os.pathsep}{env['PYTHONPATH']}"
            cwd = self.checkout
        # loraplex serve stops its own Ray cluster (and /dev/shm orphans) within its grace periods
        proxy = ["--proxy", self.proxy] if self.proxy else []
        return Launch([sys.executable, "-m", "app.cli.main", "serve", str(config), *proxy], env,
                      stop_signal=signal.SIGTERM, grace_s=90.0, cwd=cwd, ray_tmp=ray_tmp)

    def target(self) -> TargetSpec:
        return TargetSpec(name=self.name, base_url=self.base_url, base_model=self.served_model_name, keys=self.keys)
