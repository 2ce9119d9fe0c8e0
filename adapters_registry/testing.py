"""Builders of tiny base models and adapters for tests and benchmarks (no downloads).

``tiny_base_dir`` writes the embedded tiny Qwen3-MoE's config; ``peft_adapter`` trains
nothing but saves a real PEFT adapter with random (non-zero) LoRA weights on that model;
``synthetic_adapter`` writes PEFT-named tensors straight from shapes, for any base (used for
the GPT-OSS-20B-sized benchmark adapter and for hostile variants).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from .manifest import CONFIG_NAME, WEIGHTS_NAME, BaseModelInfo

# GPT-OSS-20B's config.json fields that decide LoRA shapes.
GPT_OSS_20B = dict(
    architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880, intermediate_size=2880,
    num_local_experts=32, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
    vocab_size=201088,
)

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


def tiny_base_dir(path: str | Path, with_weights: bool = False, seed: int = 0) -> Path:
    """A HF folder of the embedded tiny Qwen3-MoE (``app.embedded.model``'s config; config only
    unless ``with_weights``, then random weights of ``seed``)."""
    from app.embedded.model import tiny_qwen3_moe_config

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_qwen3_moe_config()
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    if with_weights:
        import torch
        from transformers import Qwen3MoeForCausalLM

        torch.manual_seed(seed)
        Qwen3MoeForCausalLM(cfg).save_pretrained(out)
    else:
        cfg.save_pretrained(out)
    return out


def peft_adapter(
    path: str | Path,
    base_dir: str | Path,
    kind: Literal["attn", "experts3d"] = "attn",
    r: int = 8,
    alpha: int = 16,
    seed: int = 0,
):
    """Save a PEFT LoRA adapter with random weights; returns the PEFT model (for merging checks)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(AutoConfig.from_pretrained(base_dir))
    kw: dict = {"target_modules": list(ATTN)}
    if kind == "experts3d":
        kw["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, init_lora_weights=False, **kw))
    peft_model.save_pretrained(str(path))
    return peft_model


def synthetic_adapter(
    path: str | Path,
    base: BaseModelInfo,
    r: int = 8,
    alpha: int = 16,
    attn: list[str] | None = None,
    experts: Literal["none", "2d", "3d"] = "none",
    dtype: str = "float32",
    seed: int = 0,
    scale: float = 0.01,
) -> Path:
    """PEFT-named random LoRA tensors for ``base`` (shapes from its config)."""
    import torch
    from safetensors.torch import save_file

    attn = ATTN if attn is None else attn
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    shapes = base.module_shapes()
    tensors: dict[str, torch.Tensor] = {}

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * scale).to(dt)

    for layer in range(base.num_layers):
        p = f"base_model.model.model.layers.{layer}"
        for m in attn:
            d_in, d_out = shapes[m]
            tensors[f"{p}.self_attn.{m}.lora_A.weight"] = rnd(r, d_in)
            tensors[f"{p}.self_attn.{m}.lora_B.weight"] = rnd(d_out, r)
        if experts == "3d" and base.is_moe_layer(layer):
            e_, ex = base.num_experts, base.expert_shapes()
            h, i2 = ex["gate_up_proj"]
            i, _ = ex["down_proj"]
            tensors[f"{p}.mlp.experts.base_layer.lora_A.weight"] = rnd(e_ * r, h)
            tensors[f"{p}.mlp.experts.base_layer.lora_B.weight"] = rnd(i2, r * e_)
            tensors[f"{p}.mlp.experts.lora_A.weight"] = rnd(e_ * r, i)
            tensors[f"{p}.mlp.experts.lora_B.weight"] = rnd(h, r * e_)
        elif experts == "2d" and base.is_moe_layer(layer):
            for e in range(base.num_experts):
                for leaf in ("gate_proj", "up_proj", "down_proj"):
                    d_in, d_out = base.expert_shapes()[leaf]
                    tensors[f"{p}.mlp.experts.{e}.{leaf}.lora_A.weight"] = rnd(r, d_in)
                    tensors[f"{p}.mlp.experts.{e}.{leaf}.lora_B.weight"] = rnd(d_out, r)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    targets = list(attn) + (["gate_proj", "up_proj", "down_proj"] if experts == "2d" else [])
    cfg = {
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": targets,
        "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if experts == "3d" else None,
        "lora_dropout": 0.0, "bias": "none", "use_dora": False, "fan_in_fan_out": False,
        "modules_to_save": None, "base_model_name_or_path": base.name, "task_type": "CAUSAL_LM",
    }
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2))
    return out


_ASSETS: dict[str, Path] | None = None


def tiny_assets() -> dict[str, Path]:
    """Build once per process (in a temp folder removed at exit): ``base`` (config only), ``attn``
    and ``experts3d`` (PEFT adapters on the tiny Qwen3-MoE)."""
    global _ASSETS
    if _ASSETS is None:
        import atexit
        import shutil
        import tempfile

        root = Path(tempfile.mkdtemp(prefix="loraplex-registry-assets-"))
        atexit.register(shutil.rmtree, root, True)
        base = tiny_base_dir(root / "base")
        peft_adapter(root / "attn", base, "attn", seed=1)
        peft_adapter(root / "experts3d", base, "experts3d", seed=2)
        _ASSETS = {"root": root, "base": base, "attn": root / "attn", "experts3d": root / "experts3d"}
    return _ASSETS


def asynctest(fn):
    """Run an ``async def`` test function with ``asyncio.run`` (no pytest plugin needed)."""
    import asyncio
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))

    return wrapper


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


S3_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "loraplex-test",
    "AWS_SECRET_ACCESS_KEY": "loraplex-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class _LocalS3:
    """What both local S3 servers share: an endpoint on 127.0.0.1, credentials in the environment
    while running (restored after), a boto3 client, bucket creation."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._saved: dict[str, str | None] = {}

    def _set_env(self, env: dict[str, str]) -> None:
        import os

        for k, v in env.items():
            self._saved[k] = os.environ.get(k)
            os.environ[k] = v

    def _restore_env(self) -> None:
        import os

        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def client(self):
        import boto3

        return boto3.session.Session().client("s3", endpoint_url=self.endpoint)

    def make_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name


class MotoS3(_LocalS3):
    """moto's S3 server on 127.0.0.1 (in-process thread), with test credentials in the environment."""

    def __enter__(self) -> "MotoS3":
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
        self._set_env(S3_TEST_ENV)
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()
        self._restore_env()


class StallingProxy:
    """A TCP proxy on 127.0.0.1 to ``target_port``; when ``stalled``, it accepts and then says nothing."""

    def __init__(self, target_port: int) -> None:
        import threading

        self.target_port = target_port
        self.port = free_port()
        self.stalled = threading.Event()
        self._stop = threading.Event()

    def __enter__(self) -> "StallingProxy":
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", self.port))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.thread.join(5)
        self.sock.close()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        import socket
        import threading

        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (socket.timeout, OSError):
                continue
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn) -> None:
        import socket
        import threading

        if self.stalled.is_set():
            self._stop.wait(30)
            conn.close()
            return
        up = socket.create_connection(("127.0.0.1", self.target_port))

        def pump(a, b):
            try:
                while data := a.recv(1 << 16):
                    if self.stalled.is_set():
                        self._stop.wait(30)
                        break
                    b.sendall(data)
            except OSError:
                pass
            finally:
                for s in (a, b):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        threading.Thread(target=pump, args=(up, conn), daemon=True).start()
        pump(conn, up)


class S3ServerProcess(_LocalS3):
    """A local S3 server in a child process on 127.0.0.1: ``moto`` (``moto_server``, in memory,
    any key) or ``s3rver`` (npm, on disk under ``data_dir``, checks keys: S3RVER/S3RVER).
    Sets the matching credentials in the environment while running."""

    def __init__(self, kind: Literal["moto", "s3rver"], data_dir: str | Path | None = None, s3rver_prefix: str | Path | None = None):
        super().__init__()
        self.kind = kind
        self.data_dir = Path(data_dir) if data_dir else None
        self.s3rver_prefix = Path(s3rver_prefix) if s3rver_prefix else None

    def credentials(self) -> dict[str, str]:
        if self.kind == "s3rver":
            return {"AWS_ACCESS_KEY_ID": "S3RVER", "AWS_SECRET_ACCESS_KEY": "S3RVER", "AWS_DEFAULT_REGION": "us-east-1"}
        return dict(S3_TEST_ENV)

    def __enter__(self) -> "S3ServerProcess":
        import subprocess
        import sys
        import time

        if self.kind == "moto":
            cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        else:
            script = Path(__file__).resolve().parents[1] / "scripts" / "s3rver.sh"
            assert self.data_dir is not None and self.s3rver_prefix is not None
            cmd = ["bash", str(script), "run", str(self.s3rver_prefix), str(self.data_dir), str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self._set_env(self.credentials())
        client = self.client()
        deadline = time.monotonic() + 30
        while True:
            try:
                client.list_buckets()
                break
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.__exit__()
                    raise RuntimeError(f"{self.kind} did not start on {self.endpoint}")
                time.sleep(0.1)
        return self

    def __exit__(self, *exc) -> None:
        import os
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except Exception:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._restore_env()


def install_s3rver(prefix: str | Path) -> Path | None:
    """``scripts/s3rver.sh install``; None when npm is missing or the install fails."""
    import shutil
    import subprocess

    if shutil.which("npm") is None:
        return None
    script = Path(__file__).resolve().parents[1] / "scripts" / "s3rver.sh"
    r = subprocess.run(["bash", str(script), "install", str(prefix)], capture_output=True, text=True, timeout=300)
    return Path(r.stdout.strip()) if r.returncode == 0 else None
