"""The churn test's 16-bit oracle (``TeacherForced.served_by``), calibrated on CPU: a bfloat16
greedy decode by transformers + PEFT stands in for the CUDA stack's. Each must read as its own
adapter's decode and as no other's, the long streams and the churn requests' short answers alike,
and a switch of weights mid-way must be caught; and bfloat16 must really leave the fp32 decode
early (else the exact check would do on CUDA too)."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.test_reliability_churn import CHURN_PROMPTS, PROMPT_A, SHORT, build_churn_adapters
from tests.helpers import hf_reference
from tests.helpers.greedy_margin import WINDOW, TeacherForced, hf_greedy

TOKENS = 3 * WINDOW


def _bf16_greedy(model_dir, adapter_dir, ids: list[int], n: int) -> list[int]:
    return hf_greedy(model_dir, adapter_dir, ids, n, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def folders(embedded_model_dir, tmp_path_factory) -> dict:
    """The churn test's adapters: {name: folder}."""
    return build_churn_adapters(embedded_model_dir, tmp_path_factory.mktemp("oracle"))


@pytest.fixture(scope="module")
def decodes(embedded_model_dir, folders):
    """bfloat16 decodes of A's prompt by A, B and C0, with the folders of those three."""
    three = {n: folders[n] for n in ("A", "B", "C0")}
    ids = hf_reference.prompt_ids(embedded_model_dir, PROMPT_A)
    return three, ids, {n: _bf16_greedy(embedded_model_dir, f, ids, TOKENS) for n, f in three.items()}


def test_a_bf16_decode_reads_as_its_own_adapters_and_no_others(embedded_model_dir, decodes):
    folders, ids, bf16 = decodes
    teacher = TeacherForced(embedded_model_dir)
    fp32 = hf_greedy(embedded_model_dir, folders["A"], ids, TOKENS)
    assert bf16["A"] != fp32, "bfloat16 kept fp32's greedy tokens: the exact check would hold on CUDA"
    for n, tokens in bf16.items():
        others = {o: f for o, f in folders.items() if o != n} | {"base": None}
        assert teacher.served_by(folders[n], ids, tokens, others) is None, n
        wrong = next(o for o in folders if o != n)
        assert teacher.served_by(folders[wrong], ids, tokens, {n: folders[n]}) is not None, (n, wrong)


def test_a_switch_of_weights_mid_stream_is_caught_in_its_window(embedded_model_dir, decodes):
    """A's decode up to token 60, then C0's weights continue it: the window holding the switch fails."""
    folders, ids, bf16 = decodes
    teacher = TeacherForced(embedded_model_dir)
    head = bf16["A"][:60]
    tail = _bf16_greedy(embedded_model_dir, folders["C0"], ids + head, TOKENS - 60)
    why = teacher.served_by(folders["A"], ids, head + tail, {"C0": folders["C0"], "base": None})
    assert why is not None and why.startswith(f"tokens {WINDOW}..{2 * WINDOW - 1}"), why


def test_the_churn_requests_short_answers_read_as_their_adapters(embedded_model_dir, folders):
    """8 tokens after each churn prompt, decoded in bfloat16 with its adapter, against the other
    nine adapters and the base model (the set the churn test checks them against)."""
    teacher = TeacherForced(embedded_model_dir)
    for n, prompt in CHURN_PROMPTS.items():
        ids = hf_reference.prompt_ids(embedded_model_dir, prompt)
        tokens = _bf16_greedy(embedded_model_dir, folders[n], ids, SHORT)
        others = {o: f for o, f in folders.items() if o != n} | {"base": None}
        assert teacher.served_by(folders[n], ids, tokens, others) is None, n
