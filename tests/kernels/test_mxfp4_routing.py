"""``kernels.mxfp4.routing``: the routing inputs of triton_kernels' ``matmul_ogs`` in one launch.

Anywhere (Triton interpreter without a GPU): the int16 ids, bf16 weights, bit matrix and zeroed
sums equal the PyTorch steps of vLLM 0.24's ``make_routing_data``, with padding ids (-1), odd row
counts, expert counts that are not a multiple of 32 and several top-k. On a GPU with vLLM 0.24:
the whole routing data equals ``make_routing_data``'s, field for field.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.triton_interpret import (
    interpreter_unless_cuda,
    interpreter_when_no_gpu,
)
from tests.helpers.vllm_gpu import needs_vllm024_gpu

with interpreter_unless_cuda():
    from kernels.mxfp4.routing import ROWS_PER_PROGRAM, routing_inputs

pytestmark = pytest.mark.usefixtures("interpreter_when_no_gpu")
_ = interpreter_when_no_gpu  # the fixture, used through pytestmark
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def random_topk(rows: int, top_k: int, experts: int, id_dtype, seed: int):
    """Distinct ids per row (some rows padded with -1 at the end), float32 weights."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(rows)])
    padded = torch.rand(rows, generator=g) < 0.2
    ids[padded, top_k - 1] = -1
    weights = torch.rand(rows, top_k, generator=g)
    return ids.to(id_dtype).to(DEV), weights.to(DEV)


def reference_inputs(ids: torch.Tensor, weights: torch.Tensor, experts: int):
    """vLLM 0.24 ``make_routing_data``'s steps before the sort, in PyTorch."""
    ids16 = ids.to(torch.int16)
    scal = torch.where(ids16 == -1, -1.0, weights.to(torch.bfloat16)).to(torch.bfloat16)
    words = (experts + 31) // 32
    bits = torch.zeros(ids.shape[0], words, dtype=torch.int64)
    for r, row in enumerate(ids.cpu().tolist()):
        for e in row:
            if e >= 0:
                bits[r, e // 32] |= 1 << (e % 32)
    return ids16, scal, bits


@pytest.mark.parametrize("rows,top_k,experts,id_dtype", [
    (1, 4, 32, torch.int32), (5, 1, 7, torch.int32), (ROWS_PER_PROGRAM + 3, 4, 40, torch.int64),
    (37, 6, 128, torch.int32), (2, 3, 33, torch.int64), (9, 4, 80, torch.int32)])
def test_inputs_equal_make_routing_datas_steps(rows, top_k, experts, id_dtype):
    ids, weights = random_topk(rows, top_k, experts, id_dtype, seed=rows * 7 + top_k)
    ids16, scal, bits, sums = routing_inputs(ids, weights, experts)
    want_ids, want_scal, want_bits = reference_inputs(ids, weights, experts)
    assert ids16.dtype == torch.int16 and torch.equal(ids16.cpu(), want_ids.cpu())
    assert scal.dtype == torch.bfloat16 and torch.equal(scal.cpu(), want_scal.cpu())
    assert bits.dtype == torch.uint32 and bits.shape == (rows, (experts + 31) // 32)
    got_bits = bits.view(torch.int32).cpu().to(torch.int64) & 0xFFFFFFFF
    assert torch.equal(got_bits, want_bits)
    assert sums.shape == (32 * bits.shape[1],) and not sums.cpu().any()


@needs_vllm024_gpu
# top-k a power of two: triton_kernels' sort kernel tiles 32 rows x top-k pairs (tl.arange)
@pytest.mark.parametrize("rows,top_k,experts", [(1, 4, 32), (5, 4, 32), (16, 4, 32),
                                                (1615, 4, 32), (8192, 4, 32), (300, 8, 128),
                                                (77, 2, 40)])
def test_routing_data_equals_vllms(rows, top_k, experts):
    from vllm.model_executor.layers.fused_moe.experts import (
        gpt_oss_triton_kernels_moe as oai,
    )

    if not oai.use_legacy_triton_kernels:
        pytest.skip("triton_kernels with the v3.6 API: vLLM's own routing is used")
    from kernels.mxfp4.routing import routing_data

    for seed in (rows, rows + 1):  # the second call launches the variants kept by the first
        ids, weights = random_topk(rows, top_k, experts, torch.int32, seed=seed)
        assert_same_routing(routing_data(ids, weights, experts),
                            oai.make_routing_data(ids, weights, experts))


def assert_same_routing(got, want):
    """Every field ``matmul_ogs`` reads, equal."""
    (g_route, g_gather, g_scatter), (w_route, w_gather, w_scatter) = got, want
    assert torch.equal(g_route.expt_hist, w_route.expt_hist)
    used = int(w_route.expt_hist.sum())  # sort_tokens leaves the tail of padding ids unwritten
    assert torch.equal(g_route.gate_scal[:used], w_route.gate_scal[:used])
    assert (g_route.n_expts_tot, g_route.n_expts_act) == (w_route.n_expts_tot,
                                                          w_route.n_expts_act)
    g_data, w_data = g_route.expt_data, w_route.expt_data
    assert torch.equal(g_data.hist, w_data.hist)
    assert torch.equal(g_data.token_offs_raw, w_data.token_offs_raw)
    for block_m, offs in w_data.token_offs_pad.items():
        assert torch.equal(g_data.token_offs_pad[block_m], offs)
        assert torch.equal(g_data.block_pid_map[block_m], w_data.block_pid_map[block_m])
    for g, w in ((g_gather, w_gather), (g_scatter, w_scatter)):
        assert torch.equal(g.src_indx, w.src_indx) and torch.equal(g.dst_indx, w.dst_indx)
