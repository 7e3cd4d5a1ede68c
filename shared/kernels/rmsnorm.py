"""RMSNorm (Zhang & Sennrich 2019, eq. 4), optionally fused with the residual add, in Triton.

    forward:   s = x + residual            (only with a residual; stored, it is the new residual stream)
               rstd = 1 / sqrt(mean(s^2) + eps)
               y = w * (s * rstd)

    backward:  with n = s * rstd and dn = dy * w,
               ds = rstd * (dn - n * mean(dn * n)) + ds_in     (ds_in: gradient that reached the s output)
               dx = dresidual = ds;   dw = sum over rows of dy * n

One pass over HBM each way: a program owns whole rows (BLOCK = next_power_of_2(hidden), tail masked),
so the row's mean square is a register reduction and nothing is re-read. Numerics match the reference
`rms_norm_torch` (HF LlamaRMSNorm): fp32 statistics, normalised value rounded to the input dtype before
the weight multiply.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from nano_flashattn.launch import pdl_args, pdl_prologue

from .launch import cdiv, needs_grad, next_pow2
from .reference import check_rms_norm_args

# Rows wider than this would not fit one program's registers; no Llama/Qwen hidden size comes close.
MAX_HIDDEN = 65536


@triton.jit(do_not_specialize=["n_rows"])  # the token count varies per call: one compiled variant
def _rms_norm_fwd_kernel(
    X, R, W, Y, S, RSTD,
    stride_x, stride_r, stride_y, stride_s,
    n_rows, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)  # launch overlap, where a layer turns PDL on (nano_flashattn/launch.py)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols[None, :] < n_cols)
    rows = rows.to(tl.int64)  # row * stride overflows int32 past 2^31 elements
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        # Round the sum to the storage dtype before normalising it: the model normalises the residual
        # stream it stores (HF adds in bf16), so the fused kernel must see the same rounded value.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(S.dtype.element_ty)
        tl.store(S + rows[:, None] * stride_s + cols[None, :], x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=1) / n_cols + eps)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    # HF rounds the normalised activation to the input dtype and only then multiplies by the weight.
    n = (h * rstd[:, None]).to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], (w[None, :] * n).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit(do_not_specialize=["n_rows"])  # the token count varies per call: one compiled variant
def _rms_norm_bwd_kernel(
    DY, DS, X, W, RSTD, DX, DW_PARTIAL,
    stride_dy, stride_ds, stride_x, stride_dx,
    n_rows, n_cols,
    HAS_DS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # A fixed number of programs (a few per SM) stride over row blocks, each keeping a private fp32 dW
    # accumulator: one partial row per program is written and summed afterwards, which is deterministic
    # (no atomics) and costs num_programs * hidden * 4 bytes instead of n_rows * hidden * 4.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < n_cols
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    for blk in range(pid, tl.cdiv(n_rows, ROWS), tl.num_programs(0)):
        rows = blk * ROWS + tl.arange(0, ROWS)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        rows = rows.to(tl.int64)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        h = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        n = h * rstd[:, None]
        # y = w * round(n): the weight sees the rounded activation, the chain rule through round() is 1.
        dw += tl.sum(dy * n.to(DX.dtype.element_ty).to(tl.float32), axis=0)
        dn = dy * w[None, :]
        # d(h * rstd(h))/dh applied to dn: rstd scales, and the mean(h^2) dependence removes the
        # component of dn along n.
        dh = rstd[:, None] * (dn - n * (tl.sum(dn * n, axis=1) / n_cols)[:, None])
        if HAS_DS:
            dh += tl.load(DS + rows[:, None] * stride_ds + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dh.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=col_ok)


# Elements per program (rows x BLOCK) and resident warps per SM, swept on an H200 in bf16 for hidden
# 128 (Qwen3's per-head q/k norm: millions of short rows), 1024, 4096 and 8192. Forward: 94-99% of
# copy bandwidth for all of them. Backward (a row loop, latency-bound): 74-88%; larger blocks halve
# it at hidden <= 1024, more warps per SM cost 5% at 4096.
_FWD_ELEMS, _BWD_ELEMS, _WARPS_PER_SM = 2048, 1024, 16


@functools.lru_cache(maxsize=64)
def _launch_config(n_cols: int, elems: int) -> tuple[int, int, int]:
    """(BLOCK, ROWS per program, num_warps). Short rows are packed several to a program so each
    program still moves a few KB; 16 elements per thread keeps loads 16-byte vectorised without
    spilling the fp32 row held in registers."""
    if n_cols > MAX_HIDDEN:
        raise ValueError(f"rms_norm: hidden {n_cols} > {MAX_HIDDEN} does not fit one program")
    block = next_pow2(n_cols)
    rows = max(1, min(64, elems // block))
    return block, rows, max(1, min(16, rows * block // 512))


def _num_programs(device: torch.device, n_blocks: int, num_warps: int) -> int:
    # Enough resident programs per SM to hide the row loop's load latency; on the CPU interpreter a
    # handful still exercises the loop and the partial-dW reduction.
    if device.type == "cuda":
        per_sm = max(2, _WARPS_PER_SM // num_warps)
        slots = per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        slots = 4
    return max(1, min(n_blocks, slots))


def _as_rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    t = t.reshape(-1, n_cols)
    return t if t.stride(-1) == 1 else t.contiguous()


def _rms_norm_fwd(x2d, weight, r2d, eps):
    n_rows, n_cols = x2d.shape
    block, rows, num_warps = _launch_config(n_cols, _FWD_ELEMS)
    y = torch.empty((n_rows, n_cols), dtype=x2d.dtype, device=x2d.device)
    s = torch.empty_like(y) if r2d is not None else x2d
    rstd = torch.empty((n_rows,), dtype=torch.float32, device=x2d.device)
    if n_rows:
        r = r2d if r2d is not None else x2d  # unused pointer when HAS_RESIDUAL is False
        _rms_norm_fwd_kernel[(cdiv(n_rows, rows),)](
            x2d, r, weight, y, s, rstd,
            x2d.stride(0), r.stride(0), y.stride(0), s.stride(0),
            n_rows, n_cols, eps,
            HAS_RESIDUAL=r2d is not None, ROWS=rows, BLOCK=block, num_warps=num_warps, **pdl_args(x2d.device),
        )  # fmt: skip
    return y, s, rstd


def _rms_norm_bwd(dy2d, ds2d, s2d, weight, rstd):
    n_rows, n_cols = s2d.shape
    block, rows, num_warps = _launch_config(n_cols, _BWD_ELEMS)
    dx = torch.empty((n_rows, n_cols), dtype=s2d.dtype, device=s2d.device)
    n_prog = _num_programs(s2d.device, cdiv(n_rows, rows), num_warps)
    dw_partial = torch.empty((n_prog, n_cols), dtype=torch.float32, device=s2d.device)
    if n_rows:
        ds = ds2d if ds2d is not None else dy2d
        _rms_norm_bwd_kernel[(n_prog,)](
            dy2d, ds, s2d, weight, rstd, dx, dw_partial,
            dy2d.stride(0), ds.stride(0), s2d.stride(0), dx.stride(0),
            n_rows, n_cols,
            HAS_DS=ds2d is not None, ROWS=rows, BLOCK=block, num_warps=num_warps,
        )  # fmt: skip
    else:
        dw_partial.zero_()
    return dx, dw_partial.sum(0).to(weight.dtype)


def _forward(x, weight, residual, eps):
    n_cols = x.shape[-1]
    r2d = _as_rows(residual, n_cols) if residual is not None else None
    weight = weight.contiguous()  # the kernels index it with unit stride
    return (*_rms_norm_fwd(_as_rows(x, n_cols), weight, r2d, eps), weight)


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, residual, eps):
        shape = x.shape
        y, s, rstd, weight = _forward(x, weight, residual, eps)
        ctx.save_for_backward(s, weight, rstd)
        ctx.shape, ctx.has_residual = shape, residual is not None
        # Unused outputs arrive in backward as None instead of zero tensors we would have to read.
        ctx.set_materialize_grads(False)
        if residual is None:
            return y.view(shape)
        return y.view(shape), s.view(shape)

    @staticmethod
    def backward(ctx, dy, ds=None):
        s, weight, rstd = ctx.saved_tensors
        n_cols = s.shape[-1]
        dy2d = _as_rows(dy, n_cols) if dy is not None else torch.zeros_like(s)
        ds2d = _as_rows(ds, n_cols) if ds is not None else None
        dx, dw = _rms_norm_bwd(dy2d, ds2d, s, weight, rstd)
        dx = dx.view(ctx.shape)
        return dx, dw, (dx if ctx.has_residual else None), None


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (Zhang & Sennrich 2019) in Triton, with autograd; see `rms_norm_torch` for the contract.

    With `residual`: returns `(y, s)`, `s = x + residual` and `y = rmsnorm(s)`, in one kernel (vLLM's
    `fused_add_rms_norm`, out of place). Gradients reaching `y` and `s` are summed into dx = dresidual.
    """
    check_rms_norm_args(x, weight, residual)
    if not needs_grad(x, weight, residual):  # inference: no autograd node, no saved tensors
        y, s, _, _ = _forward(x, weight, residual, float(eps))
        return y.view(x.shape) if residual is None else (y.view(x.shape), s.view(x.shape))
    return _RMSNormFn.apply(x, weight, residual, float(eps))
