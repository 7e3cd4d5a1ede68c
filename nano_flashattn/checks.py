"""Argument checks shared by the Triton kernels and the torch references.

Every bad input raises `ValueError` naming the argument, before any kernel runs: a wrong stride or an
index past the cache would otherwise read garbage memory silently (or fault the GPU).

Checks that need tensor *values* (a block table pointing past the cache, cache lengths past its
capacity) cost a device->host sync, so they are skipped while a CUDA graph is being captured (where a
sync is illegal) and inside `trusted_metadata()`, which an engine that built the metadata itself from
validated host values enters (a sync per layer would stall its launch queue every step); everything
else is shape/dtype metadata and free.
"""

from __future__ import annotations

import contextlib
import math
import threading

import torch

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
REF_DTYPES = (*DTYPES, torch.float64)  # the references also run in fp64: the tests' oracle
FP8 = torch.float8_e4m3fn  # an FP8 KV cache's codes (kv_fp8.py), read with k_scale / v_scale
# head_dims the kernels take: multiples of 8 (16-byte rows in 16-bit dtypes) from 16 to 256; a tile pads its
# head axis to the next power of two. The torch references take any head_dim.
HEAD_DIMS = tuple(range(16, 257, 8))
HEAD_DIMS_TEXT = "multiples of 8 from 16 to 256"
# "No window" on one side is stored as this many positions: larger than any sequence, small enough
# that `i + diag + NO_WINDOW` stays inside int32 in the kernels.
NO_WINDOW = 1 << 30


_TRUSTED = threading.local()


@contextlib.contextmanager
def trusted_metadata():
    """Skip the value checks (the syncing ones) of block tables, cu_seqlens and cache lengths in this
    thread: for callers that derive that metadata from host values they have already validated."""
    before = getattr(_TRUSTED, "on", False)
    _TRUSTED.on = True
    try:
        yield
    finally:
        _TRUSTED.on = before


def _values_checkable(t: torch.Tensor) -> bool:
    if getattr(_TRUSTED, "on", False):
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def check_qkv(q, k, v, q_ndim: int, kv_ndim: int, names=("q", "k", "v"),
              fp8_kv: bool = False) -> tuple[int, int, int]:
    """Common checks for q, k, v laid out (..., seq, heads, head_dim); `fp8_kv`: k and v may be
    float8_e4m3fn caches (then both are).

    Returns (heads_q, heads_k, head_dim)."""
    kv_dtype = FP8 if fp8_kv and getattr(k, "dtype", None) == FP8 else getattr(q, "dtype", None)
    for name, t, ndim in zip(names, (q, k, v), (q_ndim, kv_ndim, kv_ndim)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise ValueError(
                f"{name} must have {ndim} dims (..., seqlen, heads, head_dim), got shape {tuple(t.shape)}"
            )
        if t.dtype not in REF_DTYPES and not (t is not q and t.dtype == kv_dtype):
            fp8 = " (or float8_e4m3fn with k_scale / v_scale)" if fp8_kv and t is not q else ""
            raise ValueError(f"{name} has dtype {t.dtype}; supported: fp16, bf16, fp32{fp8}")
    for name, t in zip(names[1:], (k, v)):
        if t.dtype != kv_dtype and kv_dtype == FP8:
            raise ValueError(f"{name} has dtype {t.dtype} but {names[1]} is float8_e4m3fn: both or neither")
        if t.dtype != kv_dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but q has {q.dtype}: q, k, v must share a dtype")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}: q, k, v must share a device")
    head_dim = q.shape[-1]
    if head_dim < 1:
        raise ValueError(f"head_dim {head_dim} (q.shape[-1]) must be positive")
    if k.shape[-1] != head_dim or v.shape[-1] != head_dim:
        raise ValueError(
            f"head_dim mismatch: q {head_dim}, k {k.shape[-1]}, v {v.shape[-1]} (k and v must match q)"
        )
    if k.shape != v.shape:
        raise ValueError(f"{names[2]} shape {tuple(v.shape)} must equal {names[1]} shape {tuple(k.shape)}")
    hq, hk = q.shape[-2], k.shape[-2]
    if hq % hk != 0:
        raise ValueError(f"q heads ({hq}) must be divisible by {names[1]} heads ({hk}) for GQA/MQA")
    return hq, hk, head_dim


def check_kernel_dtype(q: torch.Tensor) -> None:
    if q.dtype not in DTYPES:
        raise ValueError(f"q has dtype {q.dtype}; the kernels support fp16, bf16, fp32 (fp64: use *_torch)")


def check_kernel_head_dim(head_dim: int) -> None:
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} (q.shape[-1]) is unsupported by the kernels; supported: "
                         f"{HEAD_DIMS_TEXT} (the *_torch references take any head_dim)")


def check_scale(softmax_scale: float | None, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite float, got {softmax_scale!r}")
    return float(softmax_scale)


def check_window(window_size, causal: bool) -> tuple[int, int]:
    """flash-attn's (left, right) window, -1 meaning unbounded; causal forces right = 0.

    Returns the window with unbounded sides replaced by NO_WINDOW."""
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2):
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}")
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {window_size!r}")
    if causal:
        right = 0
    return (NO_WINDOW if left < 0 else left), (NO_WINDOW if right < 0 else right)


def check_cu_seqlens(cu: torch.Tensor, name: str, q: torch.Tensor, batch: int | None) -> int:
    """cu_seqlens: int32 (batch + 1,) prefix sums on q's device. Returns batch."""
    if not isinstance(cu, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must have shape (batch + 1,), got {tuple(cu.shape)}")
    if batch is not None and cu.numel() != batch + 1:
        raise ValueError(f"{name} has shape {tuple(cu.shape)}, expected ({batch + 1},) like cu_seqlens_q")
    if cu.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {cu.dtype}")
    if cu.device != q.device:
        raise ValueError(f"{name} is on {cu.device} but q is on {q.device}")
    return cu.numel() - 1


def check_block_table(
    block_table: torch.Tensor, batch: int, num_blocks: int, page_size: int, q: torch.Tensor
):
    if not isinstance(block_table, torch.Tensor):
        raise ValueError(f"block_table must be a torch.Tensor, got {type(block_table).__name__}")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(
            f"block_table must have shape (batch={batch}, max_pages), got {tuple(block_table.shape)}"
        )
    if block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be int32, got {block_table.dtype}")
    if block_table.device != q.device:
        raise ValueError(f"block_table is on {block_table.device} but q is on {q.device}")
    if page_size < 16 or page_size & (page_size - 1):
        raise ValueError(f"page size (k_cache.shape[1]) must be a power of two >= 16, got {page_size}")
    if block_table.numel() and _values_checkable(block_table):
        lo, hi = block_table.min().item(), block_table.max().item()
        if lo < 0 or hi >= num_blocks:
            raise ValueError(
                f"block_table points outside the cache: entries in [{lo}, {hi}], cache has {num_blocks} pages"
            )


def check_lengths_fit(cu_or_lens: torch.Tensor, name: str, capacity: int, is_cumulative: bool):
    """Each sequence's key length must fit the cache rows it can address (value check, syncs)."""
    if not _values_checkable(cu_or_lens) or cu_or_lens.numel() == 0:
        return
    lens = cu_or_lens.diff() if is_cumulative else cu_or_lens
    if lens.numel() and (lens.min().item() < 0 or lens.max().item() > capacity):
        raise ValueError(
            f"{name} has lengths in [{lens.min().item()}, {lens.max().item()}], the cache holds {capacity}"
        )


def _check_int(x, name: str, lo: int = 0) -> int:
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        x = int(x.item())
    if not isinstance(x, int) or x < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {x!r}")
    return x


def check_dense(q, k, v, causal, softmax_scale, window_size) -> tuple[float, int, int]:
    """flash_attn_func's arguments. Returns (scale, window_left, window_right)."""
    _, _, head_dim = check_qkv(q, k, v, 4, 4)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k batch ({k.shape[0]}) must equal q batch ({q.shape[0]})")
    return (check_scale(softmax_scale, head_dim), *check_window(window_size, causal))


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                 block_table, window_size) -> tuple[float, int, int, int, int]:
    """flash_attn_varlen_func's arguments. Returns (scale, left, right, max_seqlen_q, max_seqlen_k)."""
    paged = block_table is not None
    _, _, head_dim = check_qkv(q, k, v, 3, 4 if paged else 3, fp8_kv=paged)  # FP8: a paged cache
    batch = check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q, None)
    check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", q, batch)
    max_seqlen_q = _check_int(max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = _check_int(max_seqlen_k, "max_seqlen_k")
    if paged:
        check_block_table(block_table, batch, k.shape[0], k.shape[1], q)
        k_rows = block_table.shape[1] * k.shape[1]  # what one sequence can address through its table
    if _values_checkable(q):
        lq, lk = cu_seqlens_q.diff(), cu_seqlens_k.diff()
        vals = torch.stack(
            [lq.min(), lq.max(), cu_seqlens_q[-1], lk.min(), lk.max(), cu_seqlens_k[-1]]
        ).tolist()
        if vals[0] < 0 or vals[1] > max_seqlen_q or vals[2] > q.shape[0]:
            raise ValueError(
                f"cu_seqlens_q must be non-decreasing, with lengths <= max_seqlen_q ({max_seqlen_q}) and "
                f"a total <= q.shape[0] ({q.shape[0]}); got lengths in [{vals[0]}, {vals[1]}], "
                f"total {vals[2]}"
            )
        total_k = None if paged else k.shape[0]
        if vals[3] < 0 or vals[4] > max_seqlen_k or (total_k is not None and vals[5] > total_k):
            raise ValueError(
                f"cu_seqlens_k must be non-decreasing, with lengths <= max_seqlen_k ({max_seqlen_k}) and a "
                f"total <= k.shape[0] ({total_k}); got lengths in [{vals[3]}, {vals[4]}], total {vals[5]}"
            )
        if paged and vals[4] > k_rows:
            raise ValueError(f"cu_seqlens_k has a length {vals[4]} > the {k_rows} rows block_table addresses")
    return (
        check_scale(softmax_scale, head_dim),
        *check_window(window_size, causal),
        max_seqlen_q,
        max_seqlen_k,
    )


def check_tree_mask(tree_mask, q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, window_size):
    """Tree attention's mask (SpecInfer §4.2; EAGLE-2's tree mask), after `check_varlen`.

    tree_mask: bool (total_q, max_seqlen_q); row r of sequence b is its new token i = r -
    cu_seqlens_q[b], a node of b's draft tree, and tree_mask[r, t] says whether it sees b's new token
    t: its ancestors and itself. The new tokens are the last ones of b's keys (cu_seqlens_k), and
    every key before them (the cached prefix) is visible. Nodes are in topological order (a parent
    before its children), so each row's bits lie at or left of its own column, which is set; a chain
    is causal attention. Value checks (a sync) are skipped as `_values_checkable` says.
    Returns the window the kernels run it under: (NO_WINDOW, 0), causal."""
    if not isinstance(tree_mask, torch.Tensor):
        raise ValueError(f"tree_mask must be a torch.Tensor, got {type(tree_mask).__name__}")
    if tree_mask.dtype != torch.bool:
        raise ValueError(f"tree_mask must be torch.bool (True: visible), got {tree_mask.dtype}")
    if tree_mask.shape != (q.shape[0], max_seqlen_q):
        raise ValueError(
            f"tree_mask must have shape (q.shape[0]={q.shape[0]}, max_seqlen_q={max_seqlen_q}): a row "
            f"per query row, a column per new token of its sequence (cu_seqlens_q); got "
            f"{tuple(tree_mask.shape)}"
        )
    if tree_mask.device != q.device:
        raise ValueError(f"tree_mask is on {tree_mask.device} but q is on {q.device}")
    if tuple(window_size) != (-1, -1):
        raise ValueError(f"window_size {window_size!r} with tree_mask: the tree mask is the mask; "
                         "pass window_size=(-1, -1)")
    if not _values_checkable(tree_mask):
        return NO_WINDOW, 0
    first, last = cu_seqlens_q[0].item(), cu_seqlens_q[-1].item()
    lens_q = cu_seqlens_q.diff()
    rows = torch.arange(first, last, device=q.device)
    own = rows - cu_seqlens_q[:-1].repeat_interleave(lens_q)  # each row's column: itself
    bits = tree_mask[first:last]
    cols = torch.arange(max_seqlen_q, device=q.device)
    bad_self = ~bits.gather(1, own[:, None])[:, 0]
    bad_later = (bits & (cols[None, :] > own[:, None])).any(1)
    for bad, what in ((bad_self, "omits itself: tree_mask[r, i] must be True"),
                      (bad_later, "sees a later node: a parent comes before its children")):
        if bad.any():
            r = rows[bad.nonzero()[0, 0]].item()
            i = own[r - first].item()
            raise ValueError(f"tree_mask row {r} (new token {i} of its sequence) {what}")
    short = (cu_seqlens_k.diff() < lens_q).nonzero()
    if short.numel():
        b = short[0, 0].item()
        raise ValueError(f"tree_mask: sequence {b} has fewer keys (cu_seqlens_k) than new tokens "
                         "(cu_seqlens_q); its new tokens must be the last of its keys")
    return NO_WINDOW, 0


def check_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, num_splits):
    """flash_attn_with_kvcache's arguments. Returns (scale, cache_seqlens as an int32 tensor)."""
    _, _, head_dim = check_qkv(q, k_cache, v_cache, 4, 4, names=("q", "k_cache", "v_cache"),
                               fp8_kv=True)
    batch = q.shape[0]
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.shape != (batch,):
        shape = tuple(cache_seqlens.shape) if isinstance(cache_seqlens, torch.Tensor) else cache_seqlens
        raise ValueError(f"cache_seqlens must be an int or a ({batch},) int32 tensor, got {shape!r}")
    if cache_seqlens.dtype != torch.int32:
        raise ValueError(f"cache_seqlens must be int32, got {cache_seqlens.dtype}")
    if cache_seqlens.device != q.device:
        raise ValueError(f"cache_seqlens is on {cache_seqlens.device} but q is on {q.device}")
    _check_int(num_splits, "num_splits")
    if block_table is not None:
        check_block_table(block_table, batch, k_cache.shape[0], k_cache.shape[1], q)
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        if k_cache.shape[0] < batch:
            raise ValueError(f"k_cache batch ({k_cache.shape[0]}) must be >= q batch ({batch})")
        capacity = k_cache.shape[1]
    check_lengths_fit(cache_seqlens, "cache_seqlens", capacity, is_cumulative=False)
    return check_scale(softmax_scale, head_dim), cache_seqlens


def check_kv_scales(q, k, k_scale, v_scale, names=("k_cache", "v_cache")):
    """An FP8 (float8_e4m3fn) K/V cache's scales: fp32 tensors of 1 element (per tensor) or heads_k (per
    kv head), on q's device, positive and finite (a value check: skipped where syncs are). Any other
    cache takes none. Returns them flat and contiguous, or (None, None)."""
    if k.dtype != FP8:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale / v_scale are for float8_e4m3fn caches; {names[0]} is {k.dtype}")
        return None, None
    heads_k, out = k.shape[-2], []
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"{name} is required: {names[0]} is float8_e4m3fn (value = code * scale)")
        if (not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.device != q.device
                or s.numel() not in (1, heads_k)):
            got = (f"{s.dtype} {tuple(s.shape)} on {s.device}" if isinstance(s, torch.Tensor)
                   else type(s).__name__)
            raise ValueError(f"{name} must be a float32 tensor of 1 (per tensor) or {heads_k} (per kv "
                             f"head) elements on {q.device}; got {got}")
        if _values_checkable(s) and not bool(((s > 0) & s.isfinite()).all()):
            raise ValueError(f"{name} must be positive and finite, got {s.flatten().tolist()[:8]}")
        out.append(s.reshape(-1).contiguous())
    return tuple(out)


def scale_stride(scale: torch.Tensor) -> int:
    """The kernels read kv head h's scale at h * stride: 0 for one scale per tensor."""
    return 1 if scale.numel() > 1 else 0


def check_store_fp8(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    """kv_fp8.store_kv_fp8's arguments. Returns k, v as (tokens, heads, head_dim) and the flat scales."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, torch.Tensor) or c.dtype != FP8 or c.dim() != 4:
            got = f"{c.dtype} {tuple(c.shape)}" if isinstance(c, torch.Tensor) else type(c).__name__
            raise ValueError(f"{name} must be a float8_e4m3fn (num_blocks, block_size, kv_heads, "
                             f"head_dim) tensor, got {got}")
        if c.stride(-1) != 1 or c.stride(0) != c.shape[1] * c.stride(1):
            raise ValueError(f"{name} strides {c.stride()}: slots (block, offset) must be evenly spaced "
                             "and head_dim contiguous")
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(f"v_cache {tuple(v_cache.shape)} / {v_cache.stride()} must match k_cache "
                         f"{tuple(k_cache.shape)} / {k_cache.stride()} in shape and strides")
    heads, dim = k_cache.shape[-2:]
    for name, t in (("k", k), ("v", v)):
        if (not isinstance(t, torch.Tensor) or t.dtype not in DTYPES or t.shape[-2:] != (heads, dim)
                or t.device != k_cache.device):
            got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else t
            raise ValueError(f"{name} must be a fp16/bf16/fp32 (..., {heads}, {dim}) tensor on "
                             f"{k_cache.device} like the cache, got {got}")
    k, v = k.reshape(-1, heads, dim), v.reshape(-1, heads, dim)
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if (not isinstance(slot_mapping, torch.Tensor) or slot_mapping.shape != (k.shape[0],)
            or slot_mapping.dtype not in (torch.int32, torch.int64)
            or slot_mapping.device != k_cache.device or v.shape != k.shape):
        got = (f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}"
               if isinstance(slot_mapping, torch.Tensor) else type(slot_mapping).__name__)
        raise ValueError(f"slot_mapping must be an int32/int64 ({k.shape[0]},) tensor on the cache's "
                         f"device, one slot per row of k (and v, shaped like k); got {got}")
    if slot_mapping.numel() and _values_checkable(slot_mapping):
        hi = slot_mapping.max().item()
        if hi >= k_cache.shape[0] * k_cache.shape[1]:
            raise ValueError(f"slot_mapping has slot {hi}, the cache has "
                             f"{k_cache.shape[0] * k_cache.shape[1]} slots")
    return (k, v, *check_kv_scales(k, k_cache, k_scale, v_scale))


def cdiv(a: int, b: int) -> int:
    """Host-side ceil(a / b). `triton.cdiv` also works inside kernels and costs microseconds per host call;
    an eager decoder step launches a few hundred kernels, and on a fast GPU their Python is the step."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Host-side `triton.next_power_of_2` without its per-call overhead (see `cdiv`)."""
    return 1 << (max(n, 1) - 1).bit_length()
