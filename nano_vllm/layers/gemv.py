"""A split-K GEMV for decode-sized batches — a performance layer: y = x Wᵀ (+ b) for M = 1..16 rows of x,
reading W once at the memory bandwidth.

A decode step of a small batch multiplies a few activation rows by every weight matrix: the work is
reading W (N × K), and a kernel is good when it keeps enough bytes in flight on every SM. cuBLAS picks
GEMM tiles that leave most SMs idle at M = 1 on some shapes (on an H200, 2026-12-01: 1.78 TB/s on
llama3-8b's o_proj against a 4.24 TB/s copy). Here:

* every program owns BLOCK_N output columns for all M rows (so W is read once) and a 1/SPLIT_K slice of
  K; M = 1 multiplies into a (BLOCK_N, BLOCK_K) fp32 accumulator and reduces it once after the loop (no
  cross-thread reduction per iteration), M = 2..16 uses `tl.dot` with the rows padded to 16;
* the K loop is indexed by whole BLOCK_K tiles, so every tile starts at a multiple of BLOCK_K and the
  compiler can prove 16-byte alignment (vector loads, and cp.async for the pipeline); rows past N are
  clamped onto row N - 1 rather than masked, so a tile of an even K is read with no mask at all;
* `tl.range(..., num_stages=NUM_STAGES)` puts the loop's loads in a software pipeline: Triton pipelines
  loads that feed no `tl.dot` only when the loop itself carries `num_stages`, so the launch option alone
  would leave the M = 1 loop unpipelined (one tile in flight per program);
* SPLIT_K is chosen so that the grid has a few programs per SM even when N is small; the partial sums go
  to an fp32 workspace and the last program of each column block (a per-block arrival counter) adds them
  in split order — deterministic, no second kernel, and the counter is reset for the next call, so the
  kernel replays inside a CUDA graph.

`GemvLinear` is nn.Linear whose forward takes this path on CUDA (bf16 / fp16) when x has at most
`EngineConfig.gemv_max_tokens` rows (default `DEFAULT_MAX_ROWS`), and cuBLAS (F.linear) otherwise; the
crossover is measured by `python -m nano_vllm.bench gemv=true`. The "runner" hook swaps every nn.Linear
of the loaded model (after fusing and tensor-parallel sharding) in place: same parameters, same names.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nano_vllm.config import REGISTRY
from shared.kernels import HAS_TRITON, use_triton
from shared.kernels.launch import cdiv

MAX_ROWS = 16  # the dot path pads the rows of x to 16
# `gemv_max_tokens` when None: one-row steps (M = 1), where the measured tiles beat cuBLAS on every
# llama3-8b shape (`python -m nano_vllm.bench gemv=true` prints the crossover). On an H200 (2026-12-01,
# `python -m nano_vllm.bench model=llama3-8b workload=batch1`, the other layers on) batch-1 decode ran
# 213.8 tok/s with it and 195.5 with cuBLAS (`engine.gemv_max_tokens=0`).
DEFAULT_MAX_ROWS = 1


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters: BLOCK_N output columns per program, BLOCK_K of K per loop iteration, K cut into
    SPLIT_K slices, num_warps per program, and NUM_STAGES tiles of W in flight per program (the loop's
    software pipeline; 1: none)."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"GemvConfig: {name} must be a power of two, got {v!r}")
        for name in ("split_k", "num_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"GemvConfig: {name} must be an int >= 1, got {v!r}")

    def __str__(self) -> str:
        return f"{self.block_n}x{self.block_k}/split{self.split_k}/w{self.num_warps}/s{self.num_stages}"


# The best M = 1 config per weight shape (N, K), from `python -m nano_vllm.bench gemv=true gemv_sweep=true
# 'gemv_rows=[1]'` on one H200 (132 SMs), which prints this table ready to paste. It applies on a GPU with
# MEASURED_M1_SMS SMs; other shapes and GPUs take the rule of `default_config`.
MEASURED_M1_SMS = 132
MEASURED_M1: dict[tuple[int, int], GemvConfig] = {  # best of the M = 1 sweep, NVIDIA H200, 2026-12-01
    (6144, 4096): GemvConfig(1, 2048, 1, 8, 1),  # qkv_proj: 2.51 TB/s (cuBLAS 2.17)
    (4096, 4096): GemvConfig(1, 2048, 1, 8, 1),  # o_proj: 2.16 TB/s (cuBLAS 1.78)
    (28672, 4096): GemvConfig(1, 2048, 1, 8, 1),  # gate_up_proj: 3.70 TB/s (cuBLAS 3.39)
    (4096, 14336): GemvConfig(4, 2048, 1, 4, 1),  # down_proj: 3.05 TB/s (cuBLAS 2.82)
    (128256, 4096): GemvConfig(4, 2048, 1, 4, 1),  # lm_head: 4.42 TB/s (cuBLAS 4.21)
    # qwen3-0.6b's LM head, NVIDIA H100 80GB HBM3, 2026-12-07 (`gemv_model=qwen3-0.6b`): the rule's
    # 8x1024/w8/s3 read 2.63 TB/s
    (151936, 1024): GemvConfig(4, 512, 1, 4, 2),  # lm_head: 2.81 TB/s (cuBLAS 2.68)
}


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (8 elsewhere: the interpreter's grid size is free)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def split_k_for(n: int, k: int, block_n: int, block_k: int, sms: int) -> int:
    """The smallest power-of-two SPLIT_K (at most 8, each slice at least 2 tiles of K long) that gives the
    grid ≥ 3 programs per SM: K is split only where N has too few column blocks to fill the GPU."""
    split, tiles = 1, cdiv(n, block_n)
    while split < 8 and tiles * split < 3 * sms and k >= 4 * split * block_k:
        split *= 2
    return split


@functools.lru_cache(maxsize=4096)
def default_config(m: int, n: int, k: int, sms: int) -> GemvConfig:
    """The measured config of `MEASURED_M1` for (N, K) at M = 1 on its GPU, else a rule: tiles of 8 × 1024
    weights with 8 warps (M = 1: each warp streams 2 KB of one row per iteration, 32 accumulator registers
    per thread) or 32 × 256 with 4 (M > 1), 3 stages, and SPLIT_K by `split_k_for`. (On an H200, 2026-12-01,
    the M = 1 rule read 1.00-1.10x cuBLAS's bandwidth on the five llama3-8b shapes; the table, 1.05-1.21x.)"""
    if m == 1 and sms == MEASURED_M1_SMS and (n, k) in MEASURED_M1:
        return MEASURED_M1[(n, k)]
    block_n, block_k, warps = (8, 1024, 8) if m == 1 else (32, 256, 4)
    return GemvConfig(block_n, block_k, split_k_for(n, k, block_n, block_k, sms), warps)


class GemvWorkspace:
    """The split-K partial sums (fp32) and per-column-block arrival counters (zero between calls) that every
    GEMV of one model shares: its kernels run one after another on one stream."""

    def __init__(self, partial_elems: int, num_counters: int, device: torch.device):
        self.partial = torch.empty(max(partial_elems, 1), dtype=torch.float32, device=device)
        self.counters = torch.zeros(max(num_counters, 1), dtype=torch.int32, device=device)

    def fits(self, m: int, n: int, config: GemvConfig) -> bool:
        return (config.split_k * m * n <= self.partial.numel()
                and cdiv(n, config.block_n) <= self.counters.numel())

    @classmethod
    def for_shapes(cls, shapes: list[tuple[int, int]], max_rows: int, device: torch.device,
                   config_of=None) -> GemvWorkspace:
        """A workspace large enough for every (N, K) of `shapes` at up to `max_rows` rows."""
        config_of = config_of or (lambda m, n, k: default_config(m, n, k, num_sms(device)))
        need_partial = need_counters = 0
        for n, k in shapes:
            for m in {1, max_rows}:
                c = config_of(m, n, k)
                need_partial = max(need_partial, c.split_k * max_rows * n if c.split_k > 1 else 0)
                need_counters = max(need_counters, cdiv(n, c.block_n))
        return cls(need_partial, need_counters, device)


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x Wᵀ + b in fp32 torch, returned in x's dtype: the specification."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


if HAS_TRITON:
    import triton
    import triton.language as tl

    from shared.kernels import pdl_args, pdl_prologue, pdl_release

    @triton.jit
    def _finish(acc, offs_m, m_ok, offs_n, n_ok, pid_n, pid_k, BIAS, OUT, stride_om, PARTIAL, COUNTERS, M, N,
                HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
        """Add the bias (first slice only), then store — through the workspace when K is split: the last
        slice of a column block to arrive sums the partials in split order and resets the counter."""
        if HAS_BIAS:
            b = tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            acc += tl.where(pid_k == 0, b, 0.0)[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
        out_ptrs = OUT + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        if SPLIT_K == 1:
            tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=mask)
        else:
            rows = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
            tl.store(PARTIAL + pid_k.to(tl.int64) * M * N + rows, acc, mask=mask)
            tl.debug_barrier()  # every thread's partial is written before the arrival is counted
            arrived = tl.atomic_add(COUNTERS + pid_n, 1)  # acq_rel: partials before, sums after
            if arrived == SPLIT_K - 1:
                total = tl.zeros(acc.shape, tl.float32)
                for s in tl.static_range(SPLIT_K):
                    total += tl.load(PARTIAL + s * M * N + rows, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(out_ptrs, total.to(OUT.dtype.element_ty), mask=mask)
                tl.atomic_xchg(COUNTERS + pid_n, 0)

    @triton.jit(do_not_specialize=["M", "iters_per_split"])
    def _gemv_m1_kernel(X, W, BIAS, OUT, PARTIAL, COUNTERS, M, N, K, stride_xm, stride_wn, stride_om,
                        iters_per_split, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr,
                        PDL: tl.constexpr):  # fmt: skip
        """One row of x: products accumulated elementwise in fp32 registers, reduced once; no tensor cores."""
        pdl_prologue(PDL, RELEASE=False)  # launch overlap with the previous kernel (nano_flashattn/launch.py)
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        # Rows past N read row N - 1 (never stored): the loads need no mask along N.
        w_rows = W + tl.minimum(offs_n, N - 1)[:, None].to(tl.int64) * stride_wn
        it_lo = pid_k * iters_per_split
        it_hi = tl.minimum(it_lo + iters_per_split, tl.cdiv(K, BLOCK_K))
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for it in tl.range(it_lo, it_hi, num_stages=NUM_STAGES):
            offs_k = it * BLOCK_K + tl.arange(0, BLOCK_K)  # a multiple of BLOCK_K: aligned vector loads
            if EVEN_K:
                w = tl.load(w_rows + offs_k[None, :])
                x = tl.load(X + offs_k)
            else:
                k_ok = offs_k < K
                w = tl.load(w_rows + offs_k[None, :], mask=k_ok[None, :], other=0.0)
                x = tl.load(X + offs_k, mask=k_ok, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        pdl_release(PDL)  # after the main loop: the next kernel's programs are placed as this one drains
        offs_m = tl.arange(0, 1)
        _finish(tl.sum(acc, axis=1)[None, :], offs_m, offs_m < M, offs_n, n_ok, pid_n, pid_k, BIAS, OUT,
                stride_om, PARTIAL, COUNTERS, M, N, HAS_BIAS, SPLIT_K)

    @triton.jit(do_not_specialize=["M", "iters_per_split"])
    def _gemv_dot_kernel(X, W, BIAS, OUT, PARTIAL, COUNTERS, M, N, K, stride_xm, stride_wn, stride_om,
                         iters_per_split, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SPLIT_K: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr,
                         IEEE: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        """2..16 rows of x, padded to 16: one `tl.dot` per K block."""
        pdl_prologue(PDL, RELEASE=False)
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        offs_m = tl.arange(0, 16)
        m_ok = offs_m < M
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        # Rows past M and N read the last real row (never stored): the loads need no mask along them.
        x_rows = X + tl.minimum(offs_m, M - 1)[:, None].to(tl.int64) * stride_xm
        w_cols = W + tl.minimum(offs_n, N - 1)[None, :].to(tl.int64) * stride_wn
        it_lo = pid_k * iters_per_split
        it_hi = tl.minimum(it_lo + iters_per_split, tl.cdiv(K, BLOCK_K))
        acc = tl.zeros([16, BLOCK_N], tl.float32)
        for it in tl.range(it_lo, it_hi, num_stages=NUM_STAGES):
            offs_k = it * BLOCK_K + tl.arange(0, BLOCK_K)
            if EVEN_K:
                x = tl.load(x_rows + offs_k[None, :])
                w = tl.load(w_cols + offs_k[:, None])  # Wᵀ's (BLOCK_K, BLOCK_N) tile
            else:
                k_ok = offs_k < K
                x = tl.load(x_rows + offs_k[None, :], mask=k_ok[None, :], other=0.0)
                w = tl.load(w_cols + offs_k[:, None], mask=k_ok[:, None], other=0.0)
            if IEEE:  # noqa: SIM108 -- fp32 inputs: full-precision products, not TF32
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
        pdl_release(PDL)
        _finish(acc, offs_m, m_ok, offs_n, n_ok, pid_n, pid_k, BIAS, OUT, stride_om, PARTIAL, COUNTERS, M, N,
                HAS_BIAS, SPLIT_K)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: GemvConfig | None = None, workspace: GemvWorkspace | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x Wᵀ + b for x (M, K) with 1 <= M <= 16, W (N, K), as the split-K Triton GEMV (fp16, bf16, fp32;
    fp32 with full-precision products), into `out` (M, N) if given. `config` defaults to `default_config`;
    a `workspace` too small for it (or none) is allocated here, which a CUDA-graph capture must not do: the
    runner layer passes one sized for its model."""
    m, k = x.shape
    n = weight.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"gemv: x must have 1..{MAX_ROWS} rows, got {m}")
    if weight.shape[1] != k or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} must agree on K, with a "
                         f"unit-stride K")
    config = config or default_config(1 if m == 1 else MAX_ROWS, n, k, num_sms(x.device))
    if m > 1 and min(config.block_n, config.block_k) < 16:
        raise ValueError(f"gemv: {m} rows take tl.dot, whose tiles need block_n and block_k >= 16, got {config}")
    if config.split_k > 1 and (workspace is None or not workspace.fits(m, n, config)):
        workspace = GemvWorkspace(config.split_k * m * n, cdiv(n, config.block_n), x.device)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"gemv: out must be ({m}, {n}) {x.dtype} with a unit-stride last dim, got "
                         f"{tuple(out.shape)} {out.dtype}")
    partial, counters = (workspace.partial, workspace.counters) if config.split_k > 1 else (out, out)
    iters_per_split = cdiv(cdiv(k, config.block_k), config.split_k)
    grid = (cdiv(n, config.block_n), config.split_k)
    args = (x, weight, bias if bias is not None else weight, out, partial, counters, m, n, k, x.stride(0),
            weight.stride(0), out.stride(0), iters_per_split)
    common = {"HAS_BIAS": bias is not None, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k,
              "SPLIT_K": config.split_k, "NUM_STAGES": config.num_stages, "EVEN_K": k % config.block_k == 0,
              "num_warps": config.num_warps, "num_stages": config.num_stages, **pdl_args(x.device)}
    if m == 1:
        _gemv_m1_kernel[grid](*args, **common)
    else:
        _gemv_dot_kernel[grid](*args, IEEE=x.dtype == torch.float32, **common)
    return out


class GemvLinear(nn.Linear):
    """nn.Linear that runs `gemv_triton` for inputs of at most `max_rows` rows on CUDA (bf16 / fp16), and
    F.linear (cuBLAS) otherwise. Made from an nn.Linear in place by `GemvLinear.swap`."""

    max_rows: int
    workspace: GemvWorkspace | None

    @classmethod
    def swap(cls, linear: nn.Linear, max_rows: int, workspace: GemvWorkspace | None) -> GemvLinear:
        linear.__class__ = cls
        linear.max_rows, linear.workspace = max_rows, workspace
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        if 0 < rows <= self.max_rows and x.dtype in (torch.float16, torch.bfloat16) and use_triton(x):
            y = gemv_triton(x.reshape(rows, x.shape[-1]), self.weight, self.bias, workspace=self.workspace)
            return y.view(*x.shape[:-1], y.shape[-1])
        return F.linear(x, self.weight, self.bias)


def apply_gemv(runner: Any) -> None:
    """The "runner" hook: every nn.Linear of the loaded model becomes a GemvLinear for steps of up to
    `EngineConfig.gemv_max_tokens` rows, sharing one workspace; on CUDA, a quantized model's AWQ layers
    take nano_quant's repacked W4 kernels for steps of up to 64 rows."""
    max_rows = runner.config.gemv_max_tokens or DEFAULT_MAX_ROWS
    if getattr(runner.model, "quantization_config", None) is not None:  # nano_quant loaded the model
        from nano_quant.linear import swap_modules

        # AWQ W4 layers on CUDA: nano_quant's module swap gives them their own GEMV / tensor-core kernel
        # for steps of 1 / 2-64 rows over a K-contiguous copy of the 4-bit weight, which replaces
        # AutoAWQ's (prefill dequantizes it); serving only, so AutoAWQ's tensors are freed.
        swap_modules(runner.model, serving_only=True)
    # Exactly nn.Linear: a quantized model's decoder layers (nano_quant's W8A8Linear, WQLinear_GEMM) keep their
    # own kernels; its 16-bit LM head still takes the GEMV.
    linears = [m for m in runner.model.modules() if type(m) is nn.Linear]
    workspace = None
    if runner.device.type == "cuda":
        workspace = GemvWorkspace.for_shapes([tuple(m.weight.shape) for m in linears], max_rows, runner.device)
    for m in linears:
        GemvLinear.swap(m, max_rows, workspace)


REGISTRY.register("runner", apply_gemv,
                  applies=lambda runner: runner.config.wants("gemv_max_tokens", runner.device))
