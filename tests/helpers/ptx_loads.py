"""The global loads of loraplex's LoRA kernels as compiled for a Hopper GPU (sm_90), without one.

``python -m tests.helpers.ptx_loads`` compiles each kernel with Triton's NVIDIA backend (its
bundled ptxas: no GPU or driver needed) once reading whole stacks and once reading slot ranks
(``kernels.lora_tiles.slot_rank``), and prints, as JSON, ``{kernel: {variant: {instruction:
count}}}`` for the PTX global loads (``ld.global.*``, ``cp.async.*``). Run in a process of its own:
kernels imported under the Triton interpreter (the CPU tests) cannot be compiled.
"""

from __future__ import annotations

import json
import re
from collections import Counter

PTR_BF16 = {"y_ptr", "act_ptr", "x_ptr", "a0_ptr", "a1_ptr", "a2_ptr", "b0_ptr", "b1_ptr", "b2_ptr"}
PTR_F32 = {"part_ptr", "part2_ptr", "scale_ptr", "topk_w_ptr"}
FLOATS = {"swiglu_alpha", "swiglu_limit", "scale"}
DIVISIBLE_BY_16 = re.compile(r"^(stride_|out_features|in_features|rank$|n[012]$|k_per_split)")
LOAD = re.compile(r"ld\.global[.\w]*|cp\.async\.\w+\.shared\.global")


def compile_loads(fn, constexprs: dict, num_warps: int = 4, num_stages: int = 2) -> dict:
    """Counts of the PTX load instructions of ``fn`` (a ``@triton.jit`` kernel) compiled for
    sm_90 with ``constexprs``; pointers and strides marked 16-byte / 16-element aligned, as a
    launch on vLLM's stacks has them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in PTR_BF16:
            signature[name] = "*bf16"
        elif name in PTR_F32:
            signature[name] = "*fp32"
        elif name in FLOATS:
            signature[name] = "fp32"
        elif name.endswith("_ptr"):
            signature[name] = "*i32"
        else:
            signature[name] = "i32"
        if signature[name].startswith("*") or DIVISIBLE_BY_16.match(name):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, signature, attrs=attrs,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": num_warps, "num_stages": num_stages}).asm["ptx"]
    return dict(Counter(LOAD.findall(ptx)))


def kernel_variants() -> dict:
    """``{kernel: (fn, common constexprs, whole-stack constexprs, slot-rank constexprs)}``:
    decode-size tiles (16 rows, rank-64 stacks) of the MoE shrink / expand (also with the
    activation and the down shrink folded in) / fused kernels and the dense expand and fused
    kernels."""
    from kernels.dense_lora.kernels import _dense_lora_expand_kernel, _dense_lora_fused_kernel
    from kernels.moe_lora.fused import _moe_lora_fused_kernel
    from kernels.moe_lora.kernels import _moe_lora_expand_kernel, _moe_lora_shrink_kernel

    moe = dict(BM=16, RP=64, NUM_SLICES=1, NAIVE=True, USE_PDL=False, ROW_MAP=False)
    return {
        "moe_shrink": (_moe_lora_shrink_kernel, dict(moe, BLOCK_K=128, EVEN_K=True),
                       dict(EVEN_R=True, SLOT_RANKS=False), dict(EVEN_R=False, SLOT_RANKS=True)),
        "moe_expand": (_moe_lora_expand_kernel,
                       dict(moe, BLOCK_N=128, EVEN_N=True, HAS_SCALE=False, MUL_ROUTED_WEIGHT=False,
                            ADD_INPUTS=True, SWIGLU=False, FOLD_DOWN=False),
                       dict(EVEN_R=True, SLOT_RANKS=False), dict(EVEN_R=False, SLOT_RANKS=True)),
        "moe_expand_fold": (_moe_lora_expand_kernel,
                            dict(moe, BLOCK_N=128, EVEN_N=True, HAS_SCALE=False,
                                 MUL_ROUTED_WEIGHT=False, ADD_INPUTS=True, SWIGLU=True,
                                 FOLD_DOWN=True),
                            dict(EVEN_R=True, SLOT_RANKS=False),
                            dict(EVEN_R=False, SLOT_RANKS=True)),
        "moe_fused": (_moe_lora_fused_kernel,
                      dict(RP=64, BLOCK_K=128, BLOCK_N=64, NUM_SLICES=1, HAS_SCALE=False,
                           MUL_ROUTED_WEIGHT=False, ADD_INPUTS=True, X_MAP=False, Y_MAP=False),
                      dict(SLOT_RANKS=False), dict(SLOT_RANKS=True)),
        "dense_expand": (_dense_lora_expand_kernel,
                         dict(BM=16, RP=64, BLOCK_N=128, EVEN_N=True, NUM_SLICES=3, ADD_INPUTS=True,
                              G_P2=16, HAS_LIVE=True, USE_PDL=False),
                         dict(EVEN_R=True, LIVE_RANKS=False), dict(EVEN_R=False, LIVE_RANKS=True)),
        "dense_fused": (_dense_lora_fused_kernel,
                        dict(BM=16, RP=64, BLOCK_K=128, BLOCK_N=512, EVEN_K=True, EVEN_N=True,
                             NUM_SLICES=3, HAS_SCALE=False, ADD_INPUTS=True, G_P2=16,
                             HAS_LIVE=True),
                        dict(EVEN_R=True, LIVE_RANKS=False), dict(EVEN_R=False, LIVE_RANKS=True)),
    }


def main() -> None:
    out = {}
    for name, (fn, common, whole, ranked) in kernel_variants().items():
        out[name] = {"whole": compile_loads(fn, {**common, **whole}),
                     "ranked": compile_loads(fn, {**common, **ranked})}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
