"""Probe: FlashAttention-3's forward schedule written in Gluon (Triton's lower-level dialect), against
nano_flashattn's Hopper layer and cuDNN on the GPU at hand (sm_90 only).

    python tools/flashattn_gluon_probe.py [--seqlens 4096 16384] [--stages 2] [--out DIR]

Triton's `tl.dot` leaves the order of the tensor-core instructions to the compiler; Gluon (`triton.experimental
.gluon`, Triton >= 3.5) exposes them: `warpgroup_mma(..., is_async=True)` issues a wgmma and returns a token,
`warpgroup_mma_wait(n)` waits until at most n groups are in flight, TMA loads land in shared-memory rings
guarded by mbarriers. That is what FA3's intra-warpgroup overlap (Shah et al. 2024, §3.2, Algorithm 2) needs:

    S_j     = Q K_j^T          (issued, not waited)
    O      += P_{j-1} V_{j-1}  (issued behind it)
    wait for S_j only; softmax(S_j) -> P_j, alpha_j   (runs while the P V product is on the tensor cores)
    wait for O; O *= alpha_j

Variant "plain" (`_gluon_fwd_kernel`, here): one partition (8 warps: two warpgroups over the 128 query rows),
K and V in `--stages`-deep TMA rings that the same warps refill (K_j's slot as soon as S_j has landed,
V_{j-1}'s after its product) — the in-warpgroup schedule alone. Variant "ws": the layer nano_flashattn/
hopper_ws.py adds FA3's producer warp and two consumer warpgroups in separate partitions. Dense batches of
whole 128-row tiles, head_dim 128, bf16. Checks each output against cuDNN's (bf16), then times each against
cuDNN and hopper.py's Triton forward (median of triton.testing.do_bench).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without an install

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from nano_flashattn.layers import hopper_ws
from nano_flashattn.layers.hopper_ws import _mask_diagonal, _softmax_tile, _tma_load, _tma_store

LOG2E = math.log2(math.e)


@gluon.jit
def _gluon_fwd_kernel(q_desc, k_desc, v_desc, o_desc, LSE, seqlen, heads, qk_scale, CAUSAL: gl.constexpr,
                      STAGES: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    pid_m = gl.program_id(0)
    if CAUSAL:  # heaviest query tiles first
        pid_m = gl.num_programs(0) - 1 - pid_m
    h = gl.program_id(1)
    b = gl.program_id(2)
    row0 = b * seqlen
    col = h * HEAD_DIM
    start_m = pid_m * BLOCK_M
    n_tiles = gl.cdiv(start_m + BLOCK_M, BLOCK_N) if CAUSAL else gl.cdiv(seqlen, BLOCK_N)

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)
    fence_async_shared()

    kv_bytes: gl.constexpr = BLOCK_N * HEAD_DIM * 2
    mbarrier.expect(q_bar, BLOCK_M * HEAD_DIM * 2)
    _tma_load(q_desc, [row0 + start_m, col], q_bar, q_smem)
    for i in gl.static_range(STAGES):  # fill the rings
        ok = i < n_tiles
        mbarrier.expect(k_bar.index(i), kv_bytes, pred=ok)
        _tma_load(k_desc, [row0 + i * BLOCK_N, col], k_bar.index(i), k_smem.index(i), pred=ok)
        mbarrier.expect(v_bar.index(i), kv_bytes, pred=ok)
        _tma_load(v_desc, [row0 + i * BLOCK_N, col], v_bar.index(i), v_smem.index(i), pred=ok)

    offs_m = start_m + gl.arange(0, BLOCK_M, layout=row_s)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    o = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)

    # prologue: S_0 and its softmax
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bar.index(0), 0)
    s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s_tok,))
    ok = n_tiles > STAGES
    mbarrier.expect(k_bar.index(0), kv_bytes, pred=ok)
    _tma_load(k_desc, [row0 + STAGES * BLOCK_N, col], k_bar.index(0), k_smem.index(0),
                                    pred=ok)
    if CAUSAL and n_tiles == 1:
        s = _mask_diagonal(s, offs_m, 0, s_layout)
    p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, qk_scale)
    p_op = gl.convert_layout(p.to(dtype), p_layout)

    for j in range(1, n_tiles):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_bar.index(slot), (j // STAGES) & 1)
        s_tok = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_bar.index(prev), ((j - 1) // STAGES) & 1)
        o_tok = warpgroup_mma(p_op, v_smem.index(prev), o, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s_tok,))  # S_j has landed; P_{j-1} V_{j-1} may still run
        nxt = j + STAGES
        ok = nxt < n_tiles
        mbarrier.expect(k_bar.index(slot), kv_bytes, pred=ok)
        _tma_load(k_desc, [row0 + nxt * BLOCK_N, col], k_bar.index(slot),
                                        k_smem.index(slot), pred=ok)
        if CAUSAL and j == n_tiles - 1:
            s = _mask_diagonal(s, offs_m, j * BLOCK_N, s_layout)
        p, alpha, m_new, l_i = _softmax_tile(s, m_i, l_i, qk_scale)
        o, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))
        nv = j - 1 + STAGES
        ok = nv < n_tiles
        mbarrier.expect(v_bar.index(prev), kv_bytes, pred=ok)
        _tma_load(v_desc, [row0 + nv * BLOCK_N, col], v_bar.index(prev), v_smem.index(prev),
                                        pred=ok)
        o = o * gl.convert_layout(alpha, row_o)[:, None]
        m_i = m_new
        p_op = gl.convert_layout(p.to(dtype), p_layout)

    last = (n_tiles - 1) % STAGES
    mbarrier.wait(v_bar.index(last), ((n_tiles - 1) // STAGES) & 1)
    o_tok = warpgroup_mma(p_op, v_smem.index(last), o, is_async=True)
    o = warpgroup_mma_wait(0, deps=(o_tok,))
    o = o / gl.convert_layout(l_i, row_o)[:, None]
    gl.store(LSE + (b * heads + h) * seqlen + offs_m, (m_i + gl.log2(l_i)) / LOG2E_C)
    q_smem.store(o.to(dtype))  # Q is no longer read: its buffer stages the O tile for the TMA store
    fence_async_shared()
    _tma_store(o_desc, [row0 + start_m, col], q_smem)
    tma.store_wait(0)
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bar.index(i))
        mbarrier.invalidate(v_bar.index(i))


LOG2E_C = gl.constexpr(LOG2E)


def gluon_forward(q, k, v, causal: bool, stages: int = 2, block_m: int = 128, block_n: int = 128):
    """q, k, v: (batch, seqlen, heads, 128) bf16, contiguous; seqlen a multiple of the tiles. Returns (out, lse)."""
    batch, seqlen, heads, d = q.shape
    if d != 128 or seqlen % block_m or seqlen % block_n or q.dtype != torch.bfloat16:
        raise ValueError(f"gluon_forward: head_dim 128, bf16, whole tiles; got {tuple(q.shape)} {q.dtype}")
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, seqlen, device=q.device, dtype=torch.float32)
    qo_layout = gl.NVMMASharedLayout.get_default_for([block_m, d], gl.bfloat16)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, d], gl.bfloat16)
    flat = lambda t: t.view(batch * seqlen, heads * d)  # noqa: E731
    q_desc = TensorDescriptor.from_tensor(flat(q), [block_m, d], qo_layout)
    o_desc = TensorDescriptor.from_tensor(flat(out), [block_m, d], qo_layout)
    k_desc = TensorDescriptor.from_tensor(flat(k), [block_n, d], kv_layout)
    v_desc = TensorDescriptor.from_tensor(flat(v), [block_n, d], kv_layout)
    _gluon_fwd_kernel[(seqlen // block_m, heads, batch)](
        q_desc, k_desc, v_desc, o_desc, lse, seqlen, heads, d**-0.5 * LOG2E, CAUSAL=causal, STAGES=stages,
        num_warps=8)
    return out, lse


def ws_forward(q, k, v, causal: bool):
    """The layer's warp-specialised kernel (nano_flashattn/layers/hopper_ws.py) on (batch, seqlen, heads, 128)
    inputs."""
    batch, seqlen, heads, d = q.shape
    out, lse = hopper_ws.ws_forward(*(t.view(batch * seqlen, heads, d) for t in (q, k, v)), batch, seqlen, seqlen,
                                    None, None, None, d**-0.5, 1 << 30, 0 if causal else 1 << 30)
    return out.view(q.shape), lse


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqlens", type=int, nargs="*", default=[4096, 16384])
    p.add_argument("--stages", type=int, nargs="*", default=[2])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--variants", nargs="*", default=["plain", "ws"], choices=["plain", "ws"],
                   help="plain: one partition (_gluon_fwd_kernel); ws: producer warp + two consumer warpgroups")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        p.error("needs an sm_90 GPU (wgmma, TMA)")
    import torch.nn.functional as F
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import nano_flashattn as fa

    hopper_ws.disable()  # "ours_triton": hopper.py's Triton forward, which this layer would stand in for
    rows = []
    for seqlen in args.seqlens:
        for causal in (False, True):
            batch, heads = max(1, args.tokens // seqlen), args.hidden // 128
            q, k, v = (torch.randn(batch, seqlen, heads, 128, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            flops = 4 * batch * seqlen**2 * heads * 128 / (2 if causal else 1)

            def tflops(fn, flops=flops):
                return flops / triton.testing.do_bench(fn, return_mode="median") / 1e9

            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            cudnn = functools.partial(F.scaled_dot_product_attention, qt, kt, vt, is_causal=causal)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ref = cudnn().transpose(1, 2)
                row = {"seqlen": seqlen, "causal": causal, "batch": batch, "heads": heads,
                       "cudnn": tflops(cudnn)}
            row["ours_triton"] = tflops(functools.partial(fa.flash_attn_func, q, k, v, causal=causal))
            variants = {}
            if "plain" in args.variants:
                variants.update({f"gluon_s{st}": functools.partial(gluon_forward, stages=st) for st in args.stages})
            if "ws" in args.variants:
                variants["gluon_ws"] = ws_forward
            for name, fn in variants.items():
                try:
                    out, _ = fn(q, k, v, causal)
                    torch.cuda.synchronize()
                except Exception as e:  # reported in the row; the probe goes on
                    row[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    print(name, row[name], flush=True)
                    continue
                row[f"{name}_max_err"] = (out.float() - ref.float()).abs().max().item()
                row[name] = tflops(functools.partial(fn, q, k, v, causal))
            rows.append(row)
            print(json.dumps(row), flush=True)
    names = [k for k in rows[0] if k.startswith("gluon") and not k.endswith("_max_err")] if rows else []
    print("\nTFLOP/s (ratio to cuDNN, max |error| against cuDNN's output)")
    print("| seqlen | causal | cuDNN | ours (Triton) | " + " | ".join(names) + " |")
    for r in rows:
        cells = " | ".join(f"{r[n]:.0f} ({r[n] / r['cudnn']:.2f}x, {r[n + '_max_err']:.1e})"
                           if isinstance(r[n], float) else "failed" for n in names)
        print(f"| {r['seqlen']} | {r['causal']} | {r['cudnn']:.0f} | {r['ours_triton']:.0f} "
              f"({r['ours_triton'] / r['cudnn']:.2f}x) | {cells} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"gluon_probe_{'_'.join(args.variants)}.json"), "w") as f:
            json.dump({"torch": torch.__version__, "triton": triton.__version__,
                       "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return {"rows": rows}


if __name__ == "__main__":
    main()
