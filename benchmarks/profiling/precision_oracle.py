"""How 16-bit rounding changes the embedded model's greedy decode, and how well the churn test's
16-bit oracle (``tests.helpers.greedy_margin.TeacherForced.served_by``) tells adapters apart.

transformers + PEFT on CPU, the churn test's prompts and adapters (``ADAPTER_SPECS``). For the
streams' adapters A and B on their prompts, ``--tokens`` greedy tokens in fp32, bfloat16 and
float16: where each 16-bit decode first leaves the fp32 one, how far its logits are from fp32's on
the same tokens (teacher-forced), how many of those steps change their argmax; then the share of
the bfloat16 decode's tokens that are the fp32 argmax of its own adapter, of every other adapter
and of the base model, per window of ``--window`` tokens. Last, each churn prompt's short answer
in bfloat16: its own adapter's argmax hits against the best other's.

    python -m benchmarks.profiling.precision_oracle [--tokens 600] [--window 100]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from app.embedded.setup import model_dir
from app.config import loraplex_home
from tests.e2e.test_reliability_churn import CHURN_PROMPTS, PROMPT_A, PROMPT_B, SHORT, build_churn_adapters
from tests.helpers import hf_reference
from tests.helpers.greedy_margin import TeacherForced, hf_greedy

STREAMS = {"A": PROMPT_A, "B": PROMPT_B}
SCORED = ("A", "B", "C0", "C1", "base")  # whose argmax a stream's tokens are scored against


def rounding_rows(base: Path, folders: dict[str, Path], n: int) -> list[str]:
    rows = []
    for name, prompt in STREAMS.items():
        ids = hf_reference.prompt_ids(base, prompt)
        fp32 = hf_greedy(base, folders[name], ids, n)
        ref = hf_reference.teacher_forced_logits(hf_reference.load_model(base, folders[name]), ids, fp32)
        for dtype in (torch.bfloat16, torch.float16):
            half = hf_greedy(base, folders[name], ids, n, dtype=dtype)
            first = next((i for i, (a, b) in enumerate(zip(half, fp32)) if a != b), None)
            half_model = hf_reference.load_model(base, folders[name]).to(dtype)
            lg = hf_reference.teacher_forced_logits(half_model, ids, fp32).float()
            diff = (lg - ref).abs().max(-1).values
            flips = int((lg.argmax(-1) != ref.argmax(-1)).sum())
            rows.append(f"| {name} | {str(dtype).removeprefix('torch.')} | {first if first is not None else 'none'} | "
                        f"{diff.median():.3f} | {diff.max():.3f} | {flips} of {n} |")
    return rows


def oracle_rows(base: Path, teacher: TeacherForced, folders: dict[str, Path | None], n: int, window: int) -> list[str]:
    rows = []
    for name, prompt in STREAMS.items():
        ids = hf_reference.prompt_ids(base, prompt)
        tokens = hf_greedy(base, folders[name], ids, n, dtype=torch.bfloat16)
        for scorer in SCORED:
            hits = teacher.argmax_hits(folders[scorer], ids, tokens)
            shares = [sum(hits[i:i + window]) / len(hits[i:i + window]) for i in range(0, n, window)]
            rows.append(f"| {name} | {scorer} | {sum(hits) / n:.0%} | {min(shares):.0%}–{max(shares):.0%} |")
    return rows


def churn_rows(base: Path, teacher: TeacherForced, folders: dict[str, Path | None]) -> list[str]:
    rows = []
    for name, prompt in CHURN_PROMPTS.items():
        ids = hf_reference.prompt_ids(base, prompt)
        tokens = hf_greedy(base, folders[name], ids, SHORT, dtype=torch.bfloat16)
        own = sum(teacher.argmax_hits(folders[name], ids, tokens))
        best, best_hits = max(((o, sum(teacher.argmax_hits(f, ids, tokens))) for o, f in folders.items() if o != name),
                              key=lambda x: x[1])
        rows.append(f"| {name} | {len(ids)} | {own} of {SHORT} | {best}: {best_hits} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=600, help="greedy tokens per stream")
    ap.add_argument("--window", type=int, default=100, help="tokens per window of the argmax shares")
    args = ap.parse_args(argv)
    base = model_dir(loraplex_home())
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        folders: dict[str, Path | None] = build_churn_adapters(base, Path(tmp))
        teacher = TeacherForced(base)  # its fp32 models, one per adapter, serve both tables below
        print(f"16-bit against fp32, {args.tokens} greedy tokens (logit differences teacher-forced on the fp32 tokens)")
        print("| adapter | dtype | first token off fp32 | max abs logit diff p50 | max | argmax changed |")
        print("|---|---|---|---|---|---|")
        print("\n".join(rounding_rows(base, folders, args.tokens)))
        folders["base"] = None
        print(f"\nbfloat16 decode scored by fp32 argmax (share of tokens; per {args.window}-token window)")
        print("| stream | scored by | all | windows |")
        print("|---|---|---|---|")
        print("\n".join(oracle_rows(base, teacher, folders, args.tokens, args.window)))
        print(f"\nchurn answers in bfloat16 ({SHORT} tokens), own adapter's argmax hits against the best other's")
        print("| adapter | prompt tokens | own | best other |")
        print("|---|---|---|---|")
        print("\n".join(churn_rows(base, teacher, folders)))


if __name__ == "__main__":
    main()
