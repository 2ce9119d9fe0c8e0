"""Pydantic models of the loraplex Serve application's arguments (the ``args:`` of a Serve config).

``deploy/config.yaml`` (embedded CPU default), ``deploy/h200.yaml`` (production) and the Helm
chart's ``serveConfigV2`` all feed these models through ``app.main:build_app``; nothing else
reads the Serve config.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.observability.config import ObservabilityConfig

EMBEDDED_MODEL = "embedded"
Topology = Literal["split", "colocated"]
TOPOLOGIES: tuple[Topology, ...] = get_args(Topology)
GATEWAY, ENGINE, SERVER = "Gateway", "Engine", "Server"
# the Serve deployments of each topology (app.main): split's ingress first
DEPLOYMENTS: dict[Topology, tuple[str, ...]] = {"split": (GATEWAY, ENGINE), "colocated": (SERVER,)}
EMBEDDED_MODEL_DIRNAME = "tiny-qwen3-moe"


def loraplex_home() -> Path:
    """The data directory: ``$LORAPLEX_HOME`` or ``~/.loraplex``."""
    return Path(os.environ.get("LORAPLEX_HOME") or Path.home() / ".loraplex").expanduser()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DeploymentOptions(_Strict):
    """Ray Serve options of one deployment (passed to ``Deployment.options``)."""

    num_replicas: int | Literal["auto"] | None = Field(
        None, description="Fixed replica count; omit when autoscaling_config is set."
    )
    autoscaling_config: dict[str, Any] | None = Field(
        None, description="Ray Serve autoscaling config (min_replicas, max_replicas, target_ongoing_requests, ...)."
    )
    max_ongoing_requests: int = Field(64, ge=1, description="Requests a replica accepts at once before Serve queues them.")
    max_replicas_per_node: int | None = Field(
        None, ge=1, description="At most this many replicas on one Ray node (1: one engine per node, so losing a "
        "node loses one replica); None: Serve places them freely.",
    )
    ray_actor_options: dict[str, Any] = Field(
        default_factory=dict, description="Ray actor options: num_cpus, num_gpus, resources, runtime_env."
    )
    health_check_period_s: float | None = Field(None, description="Seconds between replica health checks.")
    health_check_timeout_s: float | None = Field(None, description="Seconds before a health check fails.")
    graceful_shutdown_timeout_s: float | None = Field(
        None, description="Seconds a stopping replica (scale-down, upgrade) waits for its requests, streams included, "
        "before it is killed (None: the engine's default of app.main, Serve's for the gateway).",
    )
    max_surge_percent: int | None = Field(
        None, ge=0, le=100, description="Extra replicas a rolling update may start, in percent of the target, before "
        "old ones stop (None: Serve's default, 0: an old replica stops before its replacement starts).",
    )
    request_router_config: dict[str, Any] | None = Field(
        None,
        description="Ray Serve RequestRouterConfig (request_router_class, request_routing_stats_period_s, ...); "
        "None on the engine: loraplex's adapter-affinity router.",
    )

    def serve_options(self) -> dict[str, Any]:
        """The non-empty fields as keyword arguments for ``Deployment.options``."""
        return {k: v for k, v in self.model_dump().items() if v not in (None, {})}


class EngineConfig(_Strict):
    """The vLLM engine one replica runs: base model, LoRA capacity, and resource settings."""

    model: str = Field(
        EMBEDDED_MODEL,
        description="Base model: a local Hugging Face folder, a hub id resolvable offline, or 'embedded' "
        "for the tiny Qwen3-MoE that `loraplex init` builds under $LORAPLEX_HOME/models/.",
    )
    served_model_name: str = Field("loraplex-base", description="Name clients use in `model` for the base model without adapter.")
    tokenizer: str | None = Field(None, description="Tokenizer path when it differs from the model folder.")
    dtype: str = Field("auto", description="vLLM dtype: auto, float32, bfloat16, float16.")
    quantization: str | None = Field(None, description="vLLM quantization method (None: as the checkpoint says, e.g. MXFP4 for GPT-OSS).")
    load_format: str = Field("auto", description="vLLM load format; 'dummy' gives random weights for benchmarks.")
    max_model_len: int | None = Field(None, ge=16, description="Context length; None: the model's.")
    max_num_seqs: int = Field(64, ge=1, description="Sequences decoded together per step.")
    max_num_batched_tokens: int | None = Field(None, ge=16, description="Token budget per scheduler step.")
    max_loras: int = Field(4, ge=1, description="Adapters active in one batch (vLLM's GPU LoRA slots).")
    max_cpu_loras: int = Field(8, ge=1, description="Adapters registered with the engine at once: the replica's residency capacity.")
    max_cpu_lora_gib: float | None = Field(
        None, gt=0,
        description="Host memory budget for the adapters registered with the engine, counted as their files' bytes "
        "(GiB): a new adapter evicts idle ones until both this and max_cpu_loras hold. None: max_cpu_loras alone "
        "(then it must fit the host: max_cpu_loras x the largest adapter).",
    )
    max_lora_rank: int = Field(64, ge=1, le=512, description="Largest adapter rank the engine accepts.")
    lora_target_modules: list[str] | None = Field(
        None,
        description="vLLM module names the engine wraps with LoRA (None: those the registry serves LoRA for: "
        "attention, dense MLP and expert projections; see app.engine.lora_targets).",
    )
    enforce_eager: bool = Field(False, description="Disable CUDA graphs / compilation.")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="Fraction of GPU memory vLLM may take (GPU only).")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per replica (tensor parallelism).")
    cpu_kvcache_space_gib: int | None = Field(
        None, ge=1, description="KV cache size on the CPU backend (sets VLLM_CPU_KVCACHE_SPACE)."
    )
    moe_lora_plugin: bool = Field(True, description="loraplex's MoE-LoRA kernels on (the vLLM plugin switch).")
    seed: int = Field(0, description="Engine sampling seed.")
    priority_scheduling: bool = Field(
        True,
        description="Fair share inside the batch: requests carry their tenant's fair-share tag as vLLM priority "
        "(scheduling_policy=priority) and a waiting request of a better tag takes a full batch's worst slot "
        "(kernels.vllm.scheduling). Off: vLLM's first come, first served.",
    )
    priority_preempt_margin: int = Field(
        256, ge=0, description="Virtual tokens by which a waiting request must lead the worst running one to take its slot."
    )
    slot_quantum_s: float | None = Field(
        None, gt=0, description="Adapter slot rotation: when all max_loras GPU slots are held and requests of another "
        "adapter wait, the adapter that has held its slot this many seconds yields it (its requests are preempted "
        "and resume later; kernels.vllm.scheduling.slot_policy), so a request waits about a quantum, not a whole "
        "generation, for a slot. None: vLLM's rule (a slot frees when its adapter's last request ends).",
    )
    heavy_tenant_backlog_tokens: int | None = Field(
        2048, ge=0, description="With priority_scheduling: a tenant whose admitted, unserved work on a replica exceeds this "
        "many virtual tokens gets new streams in chunks of heavy_tenant_stream_interval tokens (first token at once), so "
        "relaying its flood does not cost every tenant host time. None: off.",
    )
    heavy_tenant_stream_interval: int = Field(16, ge=1, description="Tokens per streamed chunk for a heavy tenant's streams.")
    adapter_load_threads: int = Field(
        8, ge=0, description="An adapter's load (vLLM's reading of its files, the reshape of expert tensors into the "
        "slot layout, pinning) is prepared in a thread of the engine process on this many torch threads while the "
        "engine keeps stepping (kernels.vllm.lora_loads); add_lora then only registers it. 0: vLLM's way, the whole "
        "load inside the engine's loop, one adapter at a time, every stream of the batch waiting.",
    )
    adapter_pinning: Literal["deferred", "eager", "pooled"] = Field(
        "eager", description="Where the engine runs on a GPU, when a prepared adapter's host copy is page-locked "
        "(kernels.vllm.lora_pinning): 'eager' by the preparing thread before add_lora, as vLLM does (its first "
        "copies into a slot are DMA); 'pooled' copied before add_lora into a page-locked region reserved at start "
        "(adapter_pinned_region_gib; kernels.vllm.pinned_region: no page-locking during a load), as 'eager' when "
        "the region has no room; 'deferred' once add_lora has copied it into its first slot, in a thread of the "
        "engine process (add_lora returns sooner, but the page-locking then stalls the engine's next steps: the "
        "cold request's first token waits for it). Loads not prepared off the loop (adapter_load_threads 0) are "
        "pinned as vLLM pins them.",
    )
    adapter_pinned_region_gib: float = Field(
        0.0, ge=0, description="With adapter_pinning 'pooled': GiB of host memory page-locked once at start (before "
        "the replica is ready) to hold adapters' host copies; counts against the host's memory for the replica's "
        "life. 0 with 'pooled' is refused.",
    )
    shape_warmup: bool = Field(
        True, description="Before the replica takes traffic, one base-model step of every token-count class up to "
        "max_num_batched_tokens (app.engine.shape_warmup), so kernels that compile a variant per class do it then, "
        "not in the middle of serving.",
    )
    extra_engine_args: dict[str, Any] = Field(
        default_factory=dict, description="Further vLLM AsyncEngineArgs fields, passed through unchanged."
    )

    def resolved_model(self) -> str:
        """The model path vLLM loads (``embedded`` → the folder built by ``loraplex init``)."""
        if self.model == EMBEDDED_MODEL:
            return str(loraplex_home() / "models" / EMBEDDED_MODEL_DIRNAME)
        return self.model

    @model_validator(mode="after")
    def _check_loras(self) -> "EngineConfig":
        if self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be >= max_loras (vLLM requires it)")
        if self.adapter_pinning == "pooled" and self.adapter_pinned_region_gib <= 0:
            raise ValueError("adapter_pinning 'pooled' needs adapter_pinned_region_gib > 0 (the region adapters are "
                             "copied into), e.g. a few adapters' size")
        return self


class TenancyConfig(_Strict):
    """How tenants share the service: waits at the limits, and the quota ledger all gateway replicas share."""

    tenant_wait_s: float = Field(
        1.0, ge=0, description="Seconds a request of a tenant at its concurrency cap waits for a slot before 429 (0: at once)."
    )
    dispatch_wait_s: float = Field(
        2.0, ge=0, description="Seconds a request waits, in fair-share order, for a dispatch slot of a full gateway "
        "replica (max_in_flight_per_gateway) before 503 (0: at once).",
    )
    max_waiting_per_gateway: int = Field(256, ge=1, description="Requests waiting for a dispatch slot of one gateway replica before 503 at once.")
    max_waiting_per_tenant: int = Field(64, ge=1, description="Requests of one tenant waiting for a concurrency slot on one gateway replica before 429 at once.")
    quota_shards: int = Field(1, ge=1, description="Ray actors holding the tenants' cluster-wide budgets and concurrency (tenants hashed over them).")
    quota_sync_interval_s: float = Field(0.1, gt=0, description="Seconds between a gateway replica's syncs with the quota ledger (releases, heartbeat).")
    quota_lease_ttl_s: float = Field(10.0, gt=0, description="Seconds without a sync after which a gateway replica's leased slots return to the pool.")
    token_lease_fraction: float = Field(
        1 / 32, gt=0, le=1, description="Tokens leased to a gateway replica at a time, as a fraction of the per-minute budget "
        "(replicas × this bounds the budget left unused on idle replicas).",
    )
    spare_idle_s: float = Field(
        30.0, gt=0, description="Seconds a tenant may be idle on a gateway replica before its leased slots and tokens go back "
        "(another replica refused meanwhile recalls them at once; shorter: more requests wait on the ledger after a pause).",
    )


class S3Options(_Strict):
    """How the app's replicas read an ``s3://`` adapter store (a ``file://`` store ignores them)."""

    download_concurrency: int = Field(
        1, ge=1, le=64,
        description="GETs per adapter file. 1: each file in one streamed GET (fastest against a loopback or "
                    "in-cluster server); above 1: files larger than `part_mib` as that many parallel ranged GETs, "
                    "for stores that cap one connection's throughput (AWS S3: 8-16).")
    part_mib: int = Field(
        32, ge=5, le=5120,
        description="Range of a parallel download and part of an upload, MiB (a manifest with part hashes "
                    "downloads by its own parts).")
    connect_timeout_s: float = Field(5.0, gt=0, description="Seconds to open a connection to the store.")
    read_timeout_s: float = Field(30.0, gt=0, description="Seconds a read may wait for bytes before it is retried.")
    max_retries: int = Field(3, ge=0, le=20, description="Retries of a failed S3 call after its first attempt (botocore's standard mode).")

    def store_options(self) -> dict[str, Any]:
        """Keyword arguments of :class:`adapters_registry.stores.s3.S3AdapterStore`."""
        return {"concurrency": self.download_concurrency, "part_bytes": self.part_mib << 20,
                "connect_timeout_s": self.connect_timeout_s, "read_timeout_s": self.read_timeout_s,
                "max_attempts": self.max_retries}


class AppConfig(_Strict):
    """Arguments of ``app.main:build_app``: the whole loraplex Serve application."""

    store_uri: str | None = Field(
        None, description="Adapter store: file:///path or s3://bucket/prefix (None: $LORAPLEX_HOME/store)."
    )
    s3_endpoint_url: str | None = Field(
        None, description="S3 endpoint override (else AWS_ENDPOINT_URL, else AWS's default)."
    )
    s3: S3Options = Field(default_factory=S3Options, description="Download concurrency, timeouts and retries of an s3:// store.")
    tenants_file: str | None = Field(None, description="Tenants YAML (None: $LORAPLEX_HOME/tenants.yaml); reloaded on change.")
    cache_dir: str | None = Field(None, description="Local adapter disk cache (None: $LORAPLEX_HOME/cache).")
    cache_max_bytes: int = Field(20 * 2**30, ge=1, description="Disk cache bound in bytes (LRU beyond it).")
    max_in_flight_per_gateway: int | None = Field(
        1024, ge=1, description="Requests one gateway replica admits at once before answering 503 (None: unbounded)."
    )
    tenancy: TenancyConfig = Field(default_factory=TenancyConfig, description="Waits at tenant and gateway limits; the cluster-wide quota ledger.")
    max_request_bytes: int = Field(
        16 * 2**20, ge=1024, description="Largest OpenAI request body a gateway reads (413 beyond it)."
    )
    max_header_bytes: int = Field(
        64 * 2**10, ge=1024, description="Largest total size of an OpenAI request's headers (431 beyond it)."
    )
    topology: Topology = Field(
        "split", description="split: gateway and engine are two deployments (a Ray hop per request and per streamed "
        "chunk; requests routed to replicas by adapter). colocated: one deployment whose replicas run the gateway and "
        "the engine in one process (no hop; engine_deployment's options apply, gateway_deployment's are unused; "
        "several replicas are balanced by the proxy, not routed by adapter).",
    )
    engine: EngineConfig = Field(default_factory=EngineConfig, description="The vLLM engine of each replica.")
    engine_deployment: DeploymentOptions = Field(
        default_factory=lambda: DeploymentOptions(num_replicas=1), description="Serve options of the engine deployment."
    )
    gateway_deployment: DeploymentOptions = Field(
        default_factory=lambda: DeploymentOptions(num_replicas=1), description="Serve options of the gateway (ingress)."
    )
    observability: ObservabilityConfig = Field(
        default_factory=ObservabilityConfig, description="Metrics label caps and request logs."
    )

    def deployment_names(self) -> tuple[str, ...]:
        """The Serve deployments ``app.main:build_app`` makes for this topology (the names a Serve
        config's per-deployment ``deployments:`` overrides may use)."""
        return DEPLOYMENTS[self.topology]

    def resolved_store_uri(self) -> str:
        return self.store_uri or (loraplex_home() / "store").resolve().as_uri()

    def open_store(self):
        """The adapter store the app's replicas read (``store_uri``, ``s3_endpoint_url``, ``s3``)."""
        from adapters_registry.stores import open_store

        return open_store(self.resolved_store_uri(), self.s3_endpoint_url, **self.s3.store_options())

    def resolved_tenants_file(self) -> Path:
        return Path(self.tenants_file).expanduser() if self.tenants_file else loraplex_home() / "tenants.yaml"

    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else loraplex_home() / "cache"
