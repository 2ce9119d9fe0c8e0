"""``loraplex init``: builds the embedded default under ``$LORAPLEX_HOME`` (idempotent).

Layout: ``models/tiny-qwen3-moe/`` (HF folder), ``store/`` (local adapter store, S3 layout),
``tenants.yaml`` (hashed keys), ``demo-keys.json`` (the demo keys in clear, mode 0600, so
``loraplex serve`` can print them). Each step is skipped when its result already exists; the model
is built in a temporary folder and renamed into place, so an interrupted init leaves no half model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from app.config import EMBEDDED_MODEL_DIRNAME, loraplex_home
from app.embedded.adapters import DemoAdapterSpec, build_peft_adapter
from app.embedded.model import build_tiny_model
from app.gateway.tenants import TenantsFile

MODEL_SEED = 0
DEMO_ADAPTERS = [
    DemoAdapterSpec(adapter_id="acme-support", tenant="acme", kind="attention", rank=8, seed=11),
    DemoAdapterSpec(adapter_id="globex-legal", tenant="globex", kind="attention", rank=16, seed=22),
    DemoAdapterSpec(adapter_id="acme-experts", tenant="acme", kind="experts", rank=8, seed=33),
]
DEMO_TENANTS = {"acme": {}, "globex": {}, "operator": {"operator": True}}


def model_dir(home: Path) -> Path:
    return home / "models" / EMBEDDED_MODEL_DIRNAME


def demo_keys_path(home: Path) -> Path:
    return home / "demo-keys.json"


def is_initialized(home: Path | None = None) -> bool:
    home = home or loraplex_home()
    return (model_dir(home) / "config.json").exists() and (home / "tenants.yaml").exists() and (home / "store").exists()


def ensure_model(home: Path) -> Path:
    dest = model_dir(home)
    if (dest / "config.json").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=dest.parent))
    try:
        build_tiny_model(tmp, MODEL_SEED)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def ensure_demo_adapter(home: Path, spec: DemoAdapterSpec) -> None:
    from adapters_registry.errors import AdapterNotFound
    from adapters_registry.manifest import BaseModelInfo
    from adapters_registry.stores import open_store

    store = open_store((home / "store").resolve().as_uri())
    try:
        store.get(spec.adapter_id)
        return
    except AdapterNotFound:
        pass
    with tempfile.TemporaryDirectory() as tmp:
        src = build_peft_adapter(model_dir(home), Path(tmp), spec.kind, spec.rank, spec.seed)
        (src / "README.md").unlink(missing_ok=True)
        store.publish(src, spec.adapter_id, spec.tenant, BaseModelInfo.from_model_dir(model_dir(home)))


def ensure_tenants(home: Path) -> None:
    path = home / "tenants.yaml"
    if path.exists():
        return
    doc = TenantsFile()
    keys = {name: doc.add_key(name, **fields) for name, fields in DEMO_TENANTS.items()}
    keys_path = demo_keys_path(home)
    keys_path.write_text(json.dumps(keys, indent=2))
    os.chmod(keys_path, 0o600)
    doc.write(path)


def init(home: Path | None = None, progress: bool = True) -> Path:
    """Builds whatever part of the embedded default is missing; returns the data directory."""
    from tqdm import tqdm

    home = (home or loraplex_home()).expanduser()
    home.mkdir(parents=True, exist_ok=True)
    (home / "store").mkdir(exist_ok=True)
    steps = [("base model", lambda: ensure_model(home))]
    steps += [(f"adapter {s.adapter_id}", lambda s=s: ensure_demo_adapter(home, s)) for s in DEMO_ADAPTERS]
    steps += [("tenants", lambda: ensure_tenants(home))]
    bar = tqdm(steps, desc="loraplex init", unit="step", disable=not progress)
    for label, step in bar:
        bar.set_postfix_str(label)
        step()
    return home


def demo_keys(home: Path | None = None) -> dict[str, str]:
    path = demo_keys_path(home or loraplex_home())
    return json.loads(path.read_text()) if path.exists() else {}
