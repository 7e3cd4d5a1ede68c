"""Compile every nano_quant kernel for sm_90 without a GPU (run by test_quant_kernels in a process without
TRITON_INTERPRET): catches what the interpreter cannot — non-constexpr globals, unsupported dtypes, a GEMM
that lost wgmma or its software pipeline. Arguments get the specialisation a real launch gets (16-byte aligned
pointers, sizes and strides divisible by 16)."""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nano_quant.layers import gemv, kernels, split_k

DIVISIBLE = ("N", "NP", "K", "stride_am", "stride_bn", "stride_cm", "stride_xm", "stride_qw")


def build(fn, sig: dict, consts: dict, asm: str = "ttgir", **options) -> str:
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(sig.items())
             if ty.startswith("*") or name in DIVISIBLE}
    sig = sig | {k: "constexpr" for k in consts}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm[asm]


def split(cfg: dict) -> tuple[dict, dict]:
    cfg = dict(cfg)
    return cfg, {"num_warps": cfg.pop("num_warps"), "num_stages": cfg.pop("num_stages")}


def main() -> None:
    quant = {"X": "*bf16", "Q": "*i8", "S": "*fp32", "K": "i32", "stride_x": "i32", "stride_q": "i32"}
    build(kernels._per_token_quant_kernel, quant, {"QMAX": 127.0, "IS_FP8": False, "BLOCK": 2048})
    build(kernels._per_token_quant_kernel, quant | {"Q": "*fp8e4nv"},
          {"QMAX": 448.0, "IS_FP8": True, "BLOCK": 2048})
    mm = {"A": "*i8", "B": "*i8", "SA": "*fp32", "SB": "*fp32", "BIAS": "*bf16", "C": "*bf16", "M": "i32",
          "N": "i32", "K": "i32", "stride_am": "i32", "stride_bn": "i32", "stride_cm": "i32"}
    for fp8 in (False, True):
        cfg, opts = split(kernels.scaled_mm_config(4096, 4096, 4096, fp8))
        sig = mm | ({"A": "*fp8e4nv", "B": "*fp8e4nv"} if fp8 else {})
        ir = build(kernels._scaled_mm_kernel, sig, {"IS_INT8": not fp8, "HAS_BIAS": True, **cfg}, **opts)
        assert "warp_group_dot" in ir and "async_copy" in ir, "the W8A8 GEMM lost wgmma or its pipeline"
    awq = {"X": "*bf16", "QW": "*i32", "QZ": "*i32", "S": "*fp16", "OUT": "*bf16", "M": "i32", "N": "i32",
           "K": "i32", "stride_xm": "i32", "SPLIT_K": "i32"}
    cfg, opts = split(kernels.awq_gemm_config(1, 4096, 4096, 128, 132))
    cfg.pop("SPLIT_K")
    ir = build(kernels._awq_gemm_kernel, awq, {"GROUP_SIZE": 128, **cfg}, **opts)
    assert "async_copy" in ir, "the W4A16 GEMM lost its pipeline"
    reduce = {"P": "*fp32", "BIAS": "*bf16", "OUT": "*bf16", "MN": "i32", "N": "i32"}
    build(split_k._split_k_sum_kernel, reduce, {"SPLIT_K": 4, "HAS_BIAS": True, "BLOCK": 1024})
    small = awq | {"NP": "i32", "stride_qw": "i32"}
    small = {key: small[key] for key in ("X", "QW", "QZ", "S", "OUT", "M", "N", "NP", "K", "stride_xm",
                                         "stride_qw", "SPLIT_K")}
    for m in (1, 4):
        cfg, opts = split(gemv.awq_gemv_config(m, 4096, 4096, 128, 132))
        cfg.pop("SPLIT_K")
        ptx = build(gemv._awq_gemv_kernel, small, {"GROUP_SIZE": 128, **cfg}, **opts, asm="ptx")
        # vector loads of the packed weight (8 or 16 bytes a thread: the tuned 16-word rows give v2 at M = 1)
        assert "ld.global.v4" in ptx or "ld.global.v2" in ptx, "the W4A16 GEMV lost its vector weight loads"
    dequant = {"QW": "*i32", "QZ": "*i32", "S": "*fp16", "W": "*bf16", "N": "i32"}
    build(kernels._awq_dequantize_kernel, dequant, {"GROUP_SIZE": 128, "BLOCK_K": 32, "BLOCK_N": 128})
    print(f"compiled 9 kernels for sm_90 with Triton {triton.__version__}")


if __name__ == "__main__":
    main()
