"""Atomic dQ backward — a performance layer: FlashAttention-2's Algorithm 2 as the paper writes it, one
kernel, five GEMMs per (query tile, key tile) pair.

The paper path (backward.py) runs Algorithm 2 without atomics: a dK/dV kernel over key tiles, then a dQ
kernel over query tiles that recomputes P and dS (7 GEMMs and two exp passes per tile pair). Here the
program that owns key tile j also does line 15, dQ_i += dS_ij K_j, for every query tile i it visits, adding
the (BLOCK_M, head_dim) partial into a zeroed fp32 (total_q, heads_q, head_dim) buffer with atomics; a
final cast writes dQ in the input dtype. Per tile pair that is S = K Q^T, dV += P^T dO, dP = V dO^T,
dK += dS^T Q and dQ += dS K: five GEMMs and one exp2 pass, against the paper path's seven and two.

The trade: the order in which the key tiles' partials reach a dQ row depends on scheduling, so dQ is not
bitwise reproducible from run to run (fp32 sums in a varying order), as in flash-attn's default backward.
dK and dV are. The paper path is the deterministic one.

Everything else is the paper path's: the preprocess kernel (D = rowsum(dO o O), L in base 2), the
masked / unmasked / masked runs over query tiles (`forward.tile_range`), dense and packed batches, causal
and sliding windows, GQA (the kv-head program loops over its query heads; K/V expanded per query head when
the kv-head grid is too small to fill the GPU, `configs.GQA_EXPAND_WAVES`), head_dims padded to a power of
two (every multiple of 8 from 16 to 128; head_dim 96 runs the padded 128 tile here, the split_head layer's
unpadded parts only in the paper path). A key tile that ends past its sequence masks every query tile, so
its zero-filled key rows add nothing to dQ.

Two atomic flavours, a compile-time knob of `AtomicBackwardConfig`: "pointer" (`tl.atomic_add`, relaxed,
one red.global per element) and "descriptor" (a tensor descriptor made on the device per (sequence, head),
whose `atomic_add` is a TMA reduce-add of the whole tile on sm_90; rows past the sequence end are clipped
by the hardware). `enable()` registers the launcher for the calls `applies` accepts; nothing registers on
import.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import configs
from .backward import _bwd_preprocess
from .configs import block_d
from .forward import LOG2E, dot_precision, load_tile, seq_bounds, tile_range, visible
from .interface import register_kernel

ATOMICS = ("pointer", "descriptor")
HAS_DESCRIPTOR_ATOMICS = hasattr(tl, "make_tensor_descriptor") and hasattr(
    getattr(tl, "tensor_descriptor", None), "atomic_add")
MAX_HEAD_DIM = 128  # dK, dV and K, V of a BLOCK_N key tile stay in registers: wider heads spill


@dataclass(frozen=True)
class AtomicBackwardConfig:
    """Launch knobs of `_bwd_atomic_kernel` (all compile-time)."""

    block_m: int = 64  # query rows per inner step
    block_n: int = 128  # key rows per program (K_j, V_j, dK_j, dV_j stay on chip)
    num_warps: int = 8
    num_stages: int = 2  # Q / dO tiles in flight
    atomic: str = "pointer"  # "pointer": tl.atomic_add; "descriptor": TMA reduce-add through a descriptor

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "num_warps"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value > 0 and value & (value - 1) == 0):
                raise ValueError(f"AtomicBackwardConfig.{name} must be a positive power of two, got {value!r}")
        if self.block_m < 16 or self.block_n < 16:
            raise ValueError(f"AtomicBackwardConfig: block_m and block_n must be >= 16 (tl.dot's smallest "
                             f"tile), got {self.block_m} and {self.block_n}")
        if not (isinstance(self.num_stages, int) and self.num_stages > 0):
            raise ValueError(f"AtomicBackwardConfig.num_stages must be a positive int, got {self.num_stages!r}")
        if self.atomic not in ATOMICS:
            raise ValueError(f"AtomicBackwardConfig.atomic must be one of {ATOMICS}, got {self.atomic!r}")


# By padded head width (head_dim <= 64 takes the 64 entry). Not measured yet on an H200:
# `python tools/flashattn_bwd_probe.py` times these against a grid of others, the paper path and cuDNN.
DEFAULT_CONFIGS: dict[int, AtomicBackwardConfig] = {
    64: AtomicBackwardConfig(block_m=64, block_n=128, num_warps=8, num_stages=2),
    128: AtomicBackwardConfig(block_m=64, block_n=128, num_warps=8, num_stages=2),
}
INTERPRETER_CONFIG = AtomicBackwardConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


def default_config(head_dim: int, device: torch.device) -> AtomicBackwardConfig:
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    return DEFAULT_CONFIGS[max(64, block_d(head_dim))]


@triton.jit
def _atomic_tiles(dk, dv, k, v, q_base, do_base, dq_base, dq_desc, lse_base, delta_base, offs_n, lo, hi, q_len,
                  k_len, shift, lo_w, hi_w, qk_scale, scale, stride_qt, stride_dqt, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                  DESCRIPTOR: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Algorithm 2, lines 8-17, for one key tile K_j, V_j over the query tiles i in [lo, hi), rows = keys
    (so dK_j, dV_j accumulate in registers), with line 15's dQ_i += dS_ij K_j added atomically."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    pad_d: tl.constexpr = HEAD_DIM < BLOCK_D
    for start_m in range(lo, hi, BLOCK_M):  # line 8: for 1 <= i <= T_r
        offs_m = start_m + tl.arange(0, BLOCK_M)
        ok = offs_m < q_len
        rows = offs_m[:, None] * stride_qt + offs_d[None, :]
        # line 9: load Q_i, dO_i, L_i, D_i
        q = load_tile(q_base + rows, ok[:, None], d_ok[None, :], MASKED, pad_d)
        do = load_tile(do_base + rows, ok[:, None], d_ok[None, :], MASKED, pad_d)
        lse2 = load_tile(lse_base + offs_m, ok, ok, MASKED, False)
        delta = load_tile(delta_base + offs_m, ok, ok, MASKED, False)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # line 10: S^T, (keys, queries)
        p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])  # line 11: P = exp(S - L), the one exp pass
        if MASKED:  # the window / causal edges, query rows past q_len, key rows past k_len
            p_t = tl.where(visible(offs_n, offs_m, shift, lo_w, hi_w, q_len) & (offs_n < k_len)[:, None],
                           p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)  # line 12: dV_j += P^T dO_i
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # line 13: dP = dO_i V_j^T
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)  # line 14: dS = P o (dP - D_i)
        dk = tl.dot(ds_t, q, dk, input_precision=DOT_PRECISION)  # line 16: dK_j += dS^T Q_i
        dq = tl.dot(tl.trans(ds_t), k, input_precision=DOT_PRECISION) * scale  # line 15: dS K_j
        if DESCRIPTOR:  # one TMA reduce-add of the tile; rows past q_len are clipped by the hardware
            dq_desc.atomic_add([start_m, 0], dq)
        else:
            tl.atomic_add(dq_base + offs_m[:, None] * stride_dqt + offs_d[None, :], dq,
                          mask=ok[:, None] & d_ok[None, :], sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "group", "window_left", "window_right",
                               "stride_lse_h"])
def _bwd_atomic_kernel(Q, K, V, DO, LSE2, Delta, DQ, DK, DV, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k,
                       group, qk_scale, scale, window_left, window_right, stride_qt, stride_qh, stride_kt,
                       stride_kh, stride_dqt, stride_dqh, stride_lse_h, HEAD_DIM: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       VARLEN: tl.constexpr, DESCRIPTOR: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Algorithm 2, lines 6-18, for one key tile of one kv head of one sequence, dQ included (line 5's loop
    is the grid: (cdiv(max_seqlen_k, BLOCK_N), heads_k, batch))."""
    hk = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len, k_start, k_len = seq_bounds(b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, VARLEN)
    start_n = tl.program_id(0) * BLOCK_N
    if start_n >= k_len:
        return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok, d_ok = offs_n[:, None] < k_len, offs_d < HEAD_DIM
    pad_d: tl.constexpr = HEAD_DIM < BLOCK_D
    kv_off = k_start.to(tl.int64) * stride_kt + hk * stride_kh
    kv_ptrs = kv_off + offs_n[:, None] * stride_kt + offs_d[None, :]
    k = load_tile(K + kv_ptrs, n_ok, d_ok[None, :], True, pad_d)  # line 6: K_j, V_j stay on chip
    v = load_tile(V + kv_ptrs, n_ok, d_ok[None, :], True, pad_d)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)  # line 7
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    diag = k_len - q_len  # the forward's mask, transposed: see backward._bwd_dkdv_kernel
    lo, full_lo, full_hi, hi = tile_range(start_n, tl.minimum(start_n + BLOCK_N, k_len), shift=-diag,
                                          lo_w=window_right, hi_w=window_left, n=q_len, BLOCK=BLOCK_M)
    # A key tile past the sequence end has zero-filled rows whose P = exp2(-L) is not 0; here they would
    # reach dQ (through dS, where the paper path's dQ kernel masks them), so all its query tiles run masked.
    partial = start_n + BLOCK_N > k_len
    full_lo = tl.where(partial, hi, full_lo)
    full_hi = tl.where(partial, hi, full_hi)
    for g in range(group):  # every query head that reads this kv head adds into the same dK, dV
        h = hk * group + g
        q_base = Q + q_start.to(tl.int64) * stride_qt + h * stride_qh
        do_base = DO + q_start.to(tl.int64) * stride_qt + h * stride_qh
        dq_base = DQ + q_start.to(tl.int64) * stride_dqt + h * stride_dqh
        if DESCRIPTOR:  # per (sequence, head): its shape ends at the sequence end (an empty one is never
            # written: at least one row keeps the descriptor well-formed) and at head_dim
            dq_desc = tl.make_tensor_descriptor(dq_base, shape=[tl.maximum(q_len, 1), HEAD_DIM],
                                                strides=[stride_dqt, 1],
                                                block_shape=[BLOCK_M, BLOCK_D])
        else:
            dq_desc = dq_base  # unused
        lse_base, delta_base = LSE2 + h * stride_lse_h + q_start, Delta + h * stride_lse_h + q_start
        for run in tl.static_range(3):  # the window edge (masked), the visible middle, the diagonal / end
            dk, dv = _atomic_tiles(
                dk, dv, k, v, q_base, do_base, dq_base, dq_desc, lse_base, delta_base, offs_n,
                lo=lo if run == 0 else full_lo if run == 1 else full_hi,
                hi=full_lo if run == 0 else full_hi if run == 1 else hi, q_len=q_len, k_len=k_len,
                shift=-diag, lo_w=window_right, hi_w=window_left, qk_scale=qk_scale, scale=scale,
                stride_qt=stride_qt, stride_dqt=stride_dqt, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                BLOCK_M=BLOCK_M, MASKED=run != 1, DESCRIPTOR=DESCRIPTOR, DOT_PRECISION=DOT_PRECISION)
    dk = dk * scale  # S = scale * Q K^T: dK picks up the scale once, at the end
    tl.store(DK + kv_ptrs, dk.to(DK.dtype.element_ty), mask=n_ok & d_ok[None, :])  # line 18
    tl.store(DV + kv_ptrs, dv.to(DV.dtype.element_ty), mask=n_ok & d_ok[None, :])


def _interpreter_has_descriptor_atomics() -> bool:
    try:
        from triton.runtime.interpreter import InterpreterBuilder
    except ImportError:
        return False
    return hasattr(InterpreterBuilder, "create_descriptor_reduce")


def _check_descriptor_support(device: torch.device) -> None:
    if not HAS_DESCRIPTOR_ATOMICS:
        raise ValueError(f"atomic='descriptor' needs tensor descriptors with atomic_add; Triton "
                         f"{triton.__version__} has none: use atomic='pointer'")
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device) < (9, 0):
            raise ValueError("atomic='descriptor' needs TMA (sm_90 or newer): use atomic='pointer'")
        from .hopper import _ensure_allocator  # device-made descriptors need triton's allocator

        _ensure_allocator()
    elif not _interpreter_has_descriptor_atomics():
        raise ValueError(f"atomic='descriptor': the Triton {triton.__version__} interpreter has no tensor "
                         "descriptor atomics: use atomic='pointer' on CPU tensors")


def atomic_backward(do, q, k, v, out, lse, batch, seqlen_q, seqlen_k, cu_seqlens_q, cu_seqlens_k, scale,
                    window_left, window_right, config: AtomicBackwardConfig | None = None):
    """FA2 Algorithm 2 in one kernel with dQ added atomically (line 15); the arguments and results of
    `backward.attention_backward` (dq, dk, dv)."""
    total_q, heads_q, head_dim = q.shape
    heads_k = k.shape[1]
    if not (head_dim % 8 == 0 and 16 <= head_dim <= MAX_HEAD_DIM):
        raise ValueError(f"head_dim must be a multiple of 8 from 16 to {MAX_HEAD_DIM} for the atomic "
                         f"backward, got {head_dim}")
    cfg = config or default_config(head_dim, q.device)
    if not isinstance(cfg, AtomicBackwardConfig):
        raise TypeError(f"config must be an AtomicBackwardConfig, got {type(cfg).__name__}")
    if cfg.atomic == "descriptor":
        _check_descriptor_support(q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    if total_q == 0 or batch == 0:
        return torch.zeros_like(q), dk.zero_(), dv.zero_()
    do = do.contiguous()
    delta, lse2 = torch.empty_like(lse), torch.empty_like(lse)
    pre_m = 128 if q.is_cuda else 16
    _bwd_preprocess[(triton.cdiv(total_q, pre_m), heads_q)](  # Algorithm 2, line 4, the paper path's kernel
        Out=out, DO=do, LSE=lse, Delta=delta, LSE2=lse2, total_q=total_q, stride_qt=q.stride(0),
        stride_qh=q.stride(1), stride_lse_h=lse.stride(0), HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim),
        BLOCK_M=pre_m,
    )
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # line 3: dQ = 0, summed in fp32
    group = heads_q // heads_k
    programs = triton.cdiv(seqlen_k, cfg.block_n) * heads_k * batch
    expand = group > 1 and programs < configs.GQA_EXPAND_WAVES * configs.num_sms(q.device)
    if expand:  # one copy of K/V per query head, fp32 partial dK/dV summed over the group (backward.py)
        k_x, v_x = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        dk_x = torch.empty(k_x.shape, dtype=torch.float32, device=k.device)
        dv_x = torch.empty_like(dk_x)
    else:
        k_x, v_x, dk_x, dv_x = k, v, dk, dv
    _bwd_atomic_kernel[(triton.cdiv(seqlen_k, cfg.block_n), k_x.shape[1], batch)](
        Q=q, K=k_x, V=v_x, DO=do, LSE2=lse2, Delta=delta, DQ=dq_acc, DK=dk_x, DV=dv_x,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        group=1 if expand else group, qk_scale=scale * LOG2E, scale=scale, window_left=window_left,
        window_right=window_right, stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k_x.stride(0),
        stride_kh=k_x.stride(1), stride_dqt=dq_acc.stride(0), stride_dqh=dq_acc.stride(1),
        stride_lse_h=lse.stride(0), HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, VARLEN=cu_seqlens_q is not None, DESCRIPTOR=cfg.atomic == "descriptor",
        DOT_PRECISION=dot_precision(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if expand:
        dk.copy_(dk_x.view(-1, heads_k, group, head_dim).sum(2))
        dv.copy_(dv_x.view(-1, heads_k, group, head_dim).sum(2))
    return dq_acc.to(q.dtype), dk, dv


def applies(q, k, v, **arguments) -> bool:
    """The calls `atomic_backward` takes: head_dim a multiple of 8 from 16 to 128, q/k/v of one dtype,
    fp16/bf16 on CUDA, fp16/fp32 on CPU tensors (the Triton interpreter)."""
    dtypes = (torch.float16, torch.bfloat16) if q.is_cuda else (torch.float16, torch.float32)
    head_dim = q.shape[-1]
    return (head_dim % 8 == 0 and 16 <= head_dim <= MAX_HEAD_DIM and q.dtype in dtypes
            and k.dtype == q.dtype and v.dtype == q.dtype)


_REMOVE: list[Callable[[], None]] = []


def enable(config: AtomicBackwardConfig | None = None) -> Callable[[], None]:
    """Register `atomic_backward` as the "backward" kernel for the calls `applies` accepts (the backward of
    flash_attn_func and flash_attn_varlen_func). Returns the function that removes it; enabling again
    replaces the earlier registration."""
    if config is not None and not isinstance(config, AtomicBackwardConfig):
        raise TypeError(f"config must be an AtomicBackwardConfig or None, got {type(config).__name__}")
    if config is not None and config.atomic == "descriptor" and not HAS_DESCRIPTOR_ATOMICS:
        _check_descriptor_support(torch.device("cpu"))  # raises: this Triton has no descriptor atomics
    disable()
    launch = functools.partial(atomic_backward, config=config) if config else atomic_backward
    _REMOVE.append(register_kernel("backward", launch, applies))
    return disable


def disable() -> None:
    """Remove the registration `enable` made (a no-op when there is none)."""
    while _REMOVE:
        _REMOVE.pop()()
