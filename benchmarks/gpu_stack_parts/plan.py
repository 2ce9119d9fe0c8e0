"""What a run does and in which order, and what it is expected to cost before it starts.

A plan is a list of blocks, one per system, each started once and running its phases back to
back (the server start dominates on a GPU). A phase is a closed loop of the load generator:
concurrency, adapters addressed (0: the base model), their rank, popularity, request count and
token counts. Phases of the same name get the same prompts on every system.

Plans: ``tiny`` (the embedded model on a CPU: concurrency 2 and 1, 4 requests each, attention
adapters), ``default`` (the seed workload on every system at concurrency 16, 1 and 64,
loraplex's working set larger than its slots and one cold start, the routing check; about 20
minutes on one H200, so run as a few commands of one or two systems each, each later one with
``--merge`` of the one before) and ``full`` (every
variant: concurrency 1/4/16/64, ranks 16 and 64, 32 and 64 adapters over the slots, three cold
starts).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, Field

from benchmarks.shapes import GPT_OSS_20B_CONFIG, RANK, SLOTS

System = Literal["vllm-base", "vllm-lora", "ray-llm", "loraplex", "engine-alone"]
SYSTEMS: tuple[str, ...] = ("vllm-base", "vllm-lora", "ray-llm", "loraplex", "engine-alone")
LABELS = {
    "vllm-base": "(a) stock vllm serve, no LoRA",
    "vllm-lora": "(b) stock vllm serve with the adapters (loraplex's kernels off)",
    "ray-llm": "(c) ray.serve.llm (build_openai_app, LoraConfig on the local S3)",
    "loraplex": "(d) loraplex from deploy/h200.yaml (gateway, router, engine, S3 registry)",
    "engine-alone": "(e) loraplex's engine alone, in process (AsyncLLM, same settings)",
}
TENANTS = 4
WARMUP_TOKENS = 16
ZIPF = "zipf:1.1"
PLANS = ("tiny", "default", "full")


class Workload(BaseModel):
    """The seed workload of a model."""

    input_len: int = Field(description="Prompt tokens of every request.")
    output_len: int = Field(description="Output tokens of every request (ignore_eos).")
    concurrency: int = Field(description="The seed concurrency.")
    adapters: int = Field(description="Adapters of the seed workload.")
    rank: int = Field(description="Their rank.")
    slots: int = Field(description="max_loras: adapters in one batch.")
    expert_lora: bool = Field(description="Adapters carry expert LoRA (else attention only).")


WORKLOADS = {
    "gpu": Workload(input_len=1600, output_len=600, concurrency=16, adapters=SLOTS, rank=RANK, slots=SLOTS,
                    expert_lora=True),
    "cpu": Workload(input_len=32, output_len=16, concurrency=2, adapters=2, rank=8, slots=2, expert_lora=False),
}


class PhaseSpec(BaseModel):
    """One closed-loop phase."""

    name: str = Field(description="Unique on a system; the same name means the same prompts on every system.")
    concurrency: int = Field(ge=1)
    adapters: int = Field(ge=0, description="Adapters addressed (ids r<rank>-0 ...); 0: the base model alone.")
    rank: int = Field(ge=1)
    popularity: str = Field("round-robin", description="round-robin, uniform or zipf:<s> over the adapters.")
    requests: int = Field(ge=1, description="Measured requests.")
    input_len: int = Field(ge=1)
    output_len: int = Field(ge=1)

    @property
    def warmup(self) -> int:
        """Warm-up requests (WARMUP_TOKENS output tokens each): every adapter once, every worker."""
        return max(self.concurrency, self.adapters)


class SystemBlock(BaseModel):
    """One system: started once, its phases back to back, then its extra measurements."""

    system: System
    phases: list[PhaseSpec]
    cold_starts: int = Field(0, ge=0, description="Fresh adapters pushed and timed to their first token.")
    route_check: bool = Field(False, description="Routing check by hooks on the routers (an eager engine).")


class Plan(BaseModel):
    name: str
    model: str = Field(description="gptoss, gptoss-mxfp4 or embedded.")
    workload: Workload
    blocks: list[SystemBlock]
    selected_phases: list[str] | None = Field(None, description="Only these of the plan's phases run (None: all).")
    cold_start_count: int | None = Field(None, description="Cold starts of loraplex instead of the plan's (None: the plan's).")
    cross_checked: list[str] = Field(default_factory=list, description="Phases vllm bench also runs, beside ours, on "
                                                                       "every HTTP system (--vllm-bench).")

    def families(self, systems: tuple[str, ...] | None = None) -> dict[int, int]:
        """Adapters needed per rank (by the blocks of ``systems``, default all)."""
        out: dict[int, int] = {}
        for b in self.blocks:
            if systems is None or b.system in systems:
                for p in b.phases:
                    if p.adapters:
                        out[p.rank] = max(out.get(p.rank, 0), p.adapters)
        return out

    def cold_starts(self) -> int:
        return sum(b.cold_starts for b in self.blocks)


COLD_PREFIX = "cold-"


def adapter_id(rank: int, index: int) -> str:
    return f"r{rank}-{index}"


def adapter_ids(rank: int, count: int) -> list[str]:
    return [adapter_id(rank, i) for i in range(count)]


def cold_id(rank: int, k: int) -> str:
    """The ``k``-th fresh adapter of a cold start."""
    return f"{COLD_PREFIX}r{rank}-{k}"


def tenant_of(index: int) -> str:
    """Adapters are spread over the tenants round-robin."""
    return f"tenant-{index % TENANTS + 1}"


def http_phase_names(blocks: list[SystemBlock]) -> set[str]:
    """Names of the phases some system of ``blocks`` serves over HTTP (all but the engine alone)."""
    return {p.name for b in blocks if b.system != "engine-alone" for p in b.phases}


def build_plan(name: str, model: str, systems: tuple[str, ...] = SYSTEMS, route_check: bool = True,
               phases: list[str] | None = None, cold_starts: int | None = None,
               cross_checked: list[str] | None = None) -> Plan:
    """The plan ``name`` for ``model``, restricted to ``systems`` (in the plan's order); without
    ``route_check`` the engine alone skips the routing check (it depends on the weights only).
    ``phases``: only the phases of these names (a system left with no phase and no cold start is
    not started); ``cold_starts``: loraplex's cold starts instead of the plan's; ``cross_checked``:
    phases after which vllm bench runs the same workload on every HTTP system."""
    if name not in PLANS:
        raise ValueError(f"unknown plan {name!r}; choose from {', '.join(PLANS)}")
    if (name == "tiny") != (model == "embedded"):
        raise ValueError("the tiny plan is the embedded model's and the embedded model's plan is tiny")
    w = WORKLOADS["cpu" if model == "embedded" else "gpu"]

    def phase(pname: str, conc: int, adapters: int, rank: int = w.rank, popularity: str = "round-robin",
              requests: int | None = None) -> PhaseSpec:
        # c1: 8 requests, so that a median over them tells a ~20 ms difference of TTFT from noise
        n = requests or (4 if name == "tiny" else max(2 * conc, 8 if conc == 1 else 4,
                                                      2 * adapters if adapters > w.slots else 0))
        return PhaseSpec(name=pname, concurrency=conc, adapters=adapters, rank=rank, popularity=popularity,
                         requests=n, input_len=w.input_len, output_len=w.output_len)

    c = w.concurrency
    concs = [c, 1] if name == "tiny" else [c, 1, 4 * c] if name == "default" else [c, 1, 4, 4 * c]
    base = [phase(f"c{k}", k, 0) for k in concs]
    lora = [phase(f"c{k}", k, w.adapters) for k in concs]
    if name == "full":
        lora += [phase(f"r{r}-c{c}", c, w.adapters, rank=r) for r in (16, 64)]
    working = {"tiny": [2 * w.slots], "default": [2 * w.slots], "full": [4 * w.slots, 8 * w.slots]}[name]
    sets = [phase(f"ws{n}-{pop.split(':')[0]}", c, n, popularity=pop) for n in working for pop in ("round-robin", ZIPF)]
    blocks = [SystemBlock(system="vllm-base", phases=base), SystemBlock(system="vllm-lora", phases=lora),
              SystemBlock(system="ray-llm", phases=lora),
              SystemBlock(system="loraplex", phases=lora + sets, cold_starts=3 if name == "full" else 1),
              SystemBlock(system="engine-alone", phases=lora, route_check=route_check)]
    blocks = [b for b in blocks if b.system in systems]
    if cold_starts is not None:
        blocks = [b.model_copy(update={"cold_starts": cold_starts}) if b.system == "loraplex" else b for b in blocks]
    if phases is not None:
        known = [p.name for b in blocks for p in b.phases]
        if unknown := [n for n in phases if n not in known]:
            raise ValueError(f"phases {unknown} are not in plan {name!r} for these systems; "
                             f"choose among {', '.join(dict.fromkeys(known))}")
        blocks = [b.model_copy(update={"phases": [p for p in b.phases if p.name in phases]}) for b in blocks]
        blocks = [b for b in blocks if b.phases or b.cold_starts]
    if unknown := [n for n in cross_checked or [] if n not in http_phase_names(blocks)]:
        raise ValueError(f"--vllm-bench: no phase {', '.join(unknown)} over HTTP in this run's plan")
    return Plan(name=name, model=model, workload=w, blocks=blocks, selected_phases=phases, cold_start_count=cold_starts,
                cross_checked=list(cross_checked or []))


def rebuild_plan(plan: dict, systems: tuple[str, ...]) -> Plan:
    """The plan a report's ``plan`` was built as (its phase selection and cold starts kept),
    restricted to ``systems``."""
    built = build_plan(plan["name"], plan["model"], systems, phases=plan.get("selected_phases"),
                       cold_starts=plan.get("cold_start_count"))
    http = http_phase_names(built.blocks)
    return built.model_copy(update={"cross_checked": [n for n in plan.get("cross_checked") or [] if n in http]})


# ---- the estimate --------------------------------------------------------------------------
class Profile(BaseModel):
    """Costs the estimate assumes for one kind of host (seconds unless named otherwise)."""

    start_s: dict[str, float] = Field(description="Start to ready, per system (vLLM's compile caches cold, except the "
                                                  "engine alone's: loraplex's engine compiled it before).")
    stop_s: float
    route_check_s: float = Field(description="The eager routing engine: start and its few steps.")
    decode_step_ms: float = Field(description="One decode step without adapters.")
    lora_step_ms: float = Field(description="One decode step with adapters.")
    prefill_tok_s: float = Field(description="Prefill tokens per second.")
    model_s: float = Field(description="Model folder (and tokenizer, or the embedded default) made.")
    write_s_per_gib: float = Field(description="Writing adapter files.")
    push_s: float = Field(description="Fixed cost of one `loraplex adapters push` (process start, validation).")
    push_s_per_gib: float = Field(description="Upload per GiB at the store: the local S3 server takes one upload at "
                                              "a time's worth of bytes whatever the number of pushes at once.")
    push_workers: int = Field(description="Pushes run at once.")
    cold_start_s: float = Field(description="One cold start: its two requests (the push counted apart).")
    vllm_bench_s: float = Field(description="One vllm bench process's start and ready check (its requests apart).")


PROFILES = {
    # starts as measured on a fresh H200 machine (vLLM's compile caches cold; CUDA graphs for
    # max_num_seqs 128 take ~110 s of an engine's ~190 s init); pushes: 11 GiB in 210 s
    "gpu": Profile(start_s={"vllm-base": 180, "vllm-lora": 190, "ray-llm": 15, "loraplex": 240, "engine-alone": 200},
                   stop_s=10, route_check_s=120, decode_step_ms=11, lora_step_ms=17, prefill_tok_s=40000,
                   model_s=20, write_s_per_gib=2.0, push_s=4, push_s_per_gib=17, push_workers=4, cold_start_s=20,
                   vllm_bench_s=30),
    "cpu": Profile(start_s={"vllm-base": 60, "vllm-lora": 60, "ray-llm": 90, "loraplex": 120, "engine-alone": 50},
                   stop_s=15, route_check_s=50, decode_step_ms=40, lora_step_ms=60, prefill_tok_s=1500,
                   model_s=40, write_s_per_gib=20, push_s=12, push_s_per_gib=20, push_workers=1, cold_start_s=15,
                   vllm_bench_s=15),
}


def adapter_bytes(rank: int, expert_lora: bool = True, config: dict = GPT_OSS_20B_CONFIG) -> int:
    """Bytes of one bf16 GPT-OSS adapter of ``rank`` on attention (+ the experts)."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    e, i = config["num_local_experts"], config["intermediate_size"]
    attn = (h + q) + 2 * (h + kv) + (q + h)
    experts = e * h + 2 * i * e + e * i + h * e if expert_lora else 0
    return 2 * rank * layers * (attn + experts)


def phase_s(p: PhaseSpec, prof: Profile, warmup: bool = True) -> float:
    step = (prof.lora_step_ms if p.adapters else prof.decode_step_ms) / 1000

    def waves(n: int, out: int) -> float:
        return math.ceil(n / p.concurrency) * (p.concurrency * p.input_len / prof.prefill_tok_s + out * step)

    return (waves(p.warmup, WARMUP_TOKENS) if warmup else 0.0) + waves(p.requests, p.output_len)


def estimate(plan: Plan) -> list[tuple[str, float]]:
    """``(step, seconds)`` in the order the run takes them."""
    prof = PROFILES["cpu" if plan.model == "embedded" else "gpu"]
    gib = {r: (adapter_bytes(r, plan.workload.expert_lora) if plan.model != "embedded" else 2**20) / 2**30
           for r in {*plan.families(), plan.workload.rank}}
    local = plan.families(("vllm-lora", "ray-llm", "engine-alone"))
    pushed = plan.families(("loraplex",))
    n_push = sum(pushed.values())
    push_gib = sum(n * gib[r] for r, n in pushed.items())
    fresh_gib = sum(max(n - local.get(r, 0), 0) * gib[r] for r, n in pushed.items())
    push_s = (fresh_gib * prof.write_s_per_gib + push_gib * prof.push_s_per_gib
              + n_push * prof.push_s / prof.push_workers)
    steps = [("model folder", prof.model_s),
             (f"write {sum(local.values())} adapters", sum(n * gib[r] for r, n in local.items()) * prof.write_s_per_gib)]
    for b in plan.blocks:
        start = prof.start_s[b.system]
        if b.system == "loraplex" and n_push:  # its pushes run while it starts
            steps.append((f"push {n_push} adapters ({push_gib:.1f} GiB) while loraplex starts", push_s))
            start = max(start - push_s, 0.0)
        s = start + prof.stop_s + sum(phase_s(p, prof) for p in b.phases)
        s += b.cold_starts * (prof.cold_start_s + prof.push_s + gib[plan.workload.rank] * (
            prof.write_s_per_gib + prof.push_s_per_gib))
        steps.append((b.system, s))
        # vllm bench's run of each cross-checked phase; on loraplex our phase once more with one key first
        if checked := [p for p in b.phases if p.name in plan.cross_checked and b.system != "engine-alone"]:
            runs = 2 if b.system == "loraplex" else 1
            steps.append((f"{b.system} beside vllm bench",
                          sum(runs * phase_s(p, prof, warmup=False) + prof.vllm_bench_s for p in checked)))
        if b.route_check:
            steps.append((f"{b.system} routing check", prof.route_check_s))
    return steps


def resources(plan: Plan) -> dict[str, float]:
    """GiB the plan's adapters take: source folders kept on disk (the stock servers and the engine
    alone read them), the store's copies (moto keeps objects above a few MiB in temporary files)
    and the largest phase's adapters in loraplex's disk cache and in host memory."""
    if plan.model == "embedded":
        return {}
    size = {r: adapter_bytes(r, plan.workload.expert_lora) / 2**30 for r in {*plan.families(), plan.workload.rank}}
    local = plan.families(("vllm-lora", "ray-llm", "engine-alone"))
    lp = next((b for b in plan.blocks if b.system == "loraplex"), None)
    largest = max((p.adapters * size[p.rank] for p in lp.phases if p.adapters), default=0.0) if lp else 0.0
    store = sum(n * size[r] for r, n in plan.families().items()) + plan.cold_starts() * size[plan.workload.rank]
    return {"sources": sum(n * size[r] for r, n in local.items()), "store": store, "cache": largest,
            "host_lora": largest}


def format_plan(plan: Plan) -> str:
    """The plan as printed before the run, with its estimate."""
    lines = [(f"plan {plan.name!r} on {plan.model}: seed {plan.workload.concurrency} concurrent, "
             f"{plan.workload.input_len} in / {plan.workload.output_len} out, {plan.workload.adapters} adapters "
             f"rank {plan.workload.rank} ({'attention + experts' if plan.workload.expert_lora else 'attention'}) "
             f"over {plan.workload.slots} slots, {TENANTS} tenants")]
    for i, b in enumerate(plan.blocks, 1):
        lines.append(f"  {i}. {LABELS[b.system]}")
        for p in b.phases:
            who = f"{p.adapters} adapters r{p.rank} {p.popularity}" if p.adapters else "base model"
            lines.append(f"       {p.name:14} concurrency {p.concurrency:>3}, {who}, {p.requests} requests "
                         f"(+{p.warmup} warm-up)")
        if b.cold_starts:
            lines.append(f"       cold start: {b.cold_starts} fresh adapter(s) pushed, first and second request timed")
        if b.route_check:
            lines.append("       routing check: distinct experts per MoE layer per decode step (eager engine, hooks)")
    steps = estimate(plan)
    lines.append("estimate: " + ", ".join(f"{name} {s:.0f} s" for name, s in steps)
                 + f"; total {sum(s for _, s in steps) / 60:.1f} min")
    if res := resources(plan):
        lines.append("adapter bytes: " + ", ".join(f"{k} {v:.1f} GiB" for k, v in res.items()))
    return "\n".join(lines)
