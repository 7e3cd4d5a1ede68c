"""Compile every kernel that takes programmatic dependent launch (nano_flashattn/launch.py; the layer
nano_flashattn/layers/pdl.py turns it on, and wraps Flash-Decoding's two kernels) for sm_90 with `PDL=True` and `launch_pdl=True`, without a GPU
(run by test_pdl.py in a process without TRITON_INTERPRET, which cannot execute the grid-dependency
instructions). Checks the PTX: `griddepcontrol.wait` comes before
the first global load (the previous kernel may still be writing what this one reads), and the release
(`griddepcontrol.launch_dependents`) comes at the start for short kernels, after the main loop's first
load for the long ones."""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nano_flashattn.layers import pdl
from nano_quant.layers import repacked
from nano_vllm.layers import fused, gemv
from shared.kernels import activation, rmsnorm

FLOATS = ("eps", "qk_scale")


def ptx_of(fn, pointers: dict[str, str], consts: dict, num_warps: int = 4, num_stages: int = 1) -> str:
    """`fn` compiled for sm_90: pointer arguments typed as given, other runtime arguments i32 (fp32 for
    FLOATS), pointers and sizes assumed 16-aligned as a real launch specialises them."""
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        else:
            sig[p.name] = pointers.get(p.name, "fp32" if p.name in FLOATS else "i32")
    attrs = {(i,): [["tt.divisibility", 16]] for i, ty in enumerate(sig.values()) if ty.startswith("*")}
    if "PDL" in sig:
        consts = consts | {"PDL": True}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages, "launch_pdl": True}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def check(name: str, ptx: str, release_early: bool | None) -> None:
    """release_early: True, at the start; False, after the main loop's first load; None: none (the next
    kernel is placed as this one exits)."""
    loads = [i for i in (ptx.find("ld.global"), ptx.find("cp.async")) if i >= 0]
    first_load = min(loads)
    wait, release = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    assert 0 <= wait < first_load, f"{name}: a global load before the PDL wait"
    if release_early is None:
        assert release < 0, f"{name}: releases the next kernel before it exits"
        return
    assert release > wait, f"{name}: no release after the wait"
    if release_early:
        assert release < first_load, f"{name}: a short kernel should release the next one at its start"
    else:
        assert release > first_load, f"{name}: a long kernel should release the next one after its main loop"


def main() -> None:
    bf16 = "*bf16"
    decode_pointers = {"Q": bf16, "K": bf16, "V": bf16, "Out": "*fp32", "LSE": "*fp32",
                       "cache_seqlens": "*i32", "block_table": "*i32"}
    w4 = {"X": "*i32", "QW": "*i32", "S": bf16, "ZS": "*fp32", "OUT": bf16, "PART": "*fp32", "TICKETS": "*i32",
          "BIAS": bf16, "NW": "*i32", "R": "*i32", "ADD_H": bf16, "ADD_R": bf16}
    kernels = [
        ("Flash-Decoding split", pdl._pdl_split_kernel, decode_pointers,
         {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_M": 16, "BLOCK_N": 128, "PAGED": True, "PAGE_SIZE": 16,
          "DOT_PRECISION": "tf32"}, None),
        ("Flash-Decoding combine", pdl._pdl_combine_kernel,
         {"O_part": "*fp32", "LSE_part": "*fp32", "Out": bf16, "LSE": "*fp32"},
         {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_S": 8}, True),
        ("rms_norm", rmsnorm._rms_norm_fwd_kernel, dict.fromkeys("XRWYS", bf16) | {"RSTD": "*fp32"},
         {"HAS_RESIDUAL": True, "ROWS": 1, "BLOCK": 4096}, True),
        ("silu_and_mul", activation._silu_and_mul_fwd_kernel, dict.fromkeys(("G", "U", "OUT"), bf16),
         {"BLOCK": 1024}, True),
        ("rope_and_store", fused._rope_store_kernel,
         dict.fromkeys(("Q", "K", "V", "QOUT", "KOUT", "K_CACHE", "V_CACHE"), bf16)
         | {"COS": "*fp32", "SIN": "*fp32", "SLOTS": "*i64"},
         {"HEADS_Q": 32, "HEADS_KV": 8, "HALF": 64, "BLOCK_R": 32, "BLOCK_D": 64}, True),
        ("bf16 GEMV, one row", gemv._gemv_m1_kernel,
         dict.fromkeys(("X", "W", "BIAS", "OUT"), bf16) | {"PARTIAL": "*fp32", "COUNTERS": "*i32"},
         {"HAS_BIAS": False, "BLOCK_N": 16, "BLOCK_K": 512, "SPLIT_K": 4, "NUM_STAGES": 2, "EVEN_K": True},
         False),
        ("bf16 GEMV, tl.dot", gemv._gemv_dot_kernel,
         dict.fromkeys(("X", "W", "BIAS", "OUT"), bf16) | {"PARTIAL": "*fp32", "COUNTERS": "*i32"},
         {"HAS_BIAS": False, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 4, "NUM_STAGES": 2, "EVEN_K": True,
          "IEEE": False}, False),
        ("W4 tensor-core GEMM", repacked._awq_mma_repacked_kernel,
         {"X": bf16, "QW": "*i32", "S": bf16, "ZS": "*fp32", "OUT": bf16, "PART": "*fp32", "TICKETS": "*i32",
          "BIAS": bf16},
         {"GROUP_SIZE": 128, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "K_TILES": 1, "OFFSET": 0.0,
          "PTX": True, "NUM_STAGES": 3, "SPLIT": True, "HAS_BIAS": False, "SILU": False}, False),
        ("W4 GEMV", repacked._awq_gemv_repacked_kernel, w4,
         {"GROUP_SIZE": 128, "BLOCK_N": 32, "GPS": 2, "WPG": 16, "NUM_STAGES": 1, "EVEN": True, "X_PAIRS": True,
          "EXACT": False, "SPLIT": True, "HAS_BIAS": False, "SILU": False}, False),
        ("W4 GEMV, add + RMSNorm before, + stream after", repacked._awq_gemv_repacked_kernel, w4,
         {"GROUP_SIZE": 128, "BLOCK_N": 16, "GPS": 4, "WPG": 16, "NUM_STAGES": 4, "EVEN": True, "X_PAIRS": True,
          "EXACT": False, "SPLIT": False, "HAS_BIAS": False, "SILU": False, "NORM": True, "HAS_RES": True,
          "ADD": 2}, False),
    ]
    for name, fn, pointers, consts, release_early in kernels:
        stages = consts.get("NUM_STAGES", 1)
        check(name, ptx_of(fn, pointers, consts, num_stages=stages), release_early)
    print(f"PDL checked in {len(kernels)} kernels for sm_90 with Triton {triton.__version__}")


if __name__ == "__main__":
    main()
