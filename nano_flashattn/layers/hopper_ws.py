"""Warp-specialised Hopper forward and backward in Gluon — a performance layer: FlashAttention-2's Algorithms
1 and 2 with FlashAttention-3's scheduling (Shah et al. 2024, arXiv 2407.08608, §3.1, §3.2 and appendix B.1),
for dense batches at head_dim 128 (forward) and 64 / 128 (backward) on sm_90.

`hopper.py` writes the forward in Triton, where `tl.dot` leaves the order of the tensor-core instructions and
the division of warps to the compiler; on Triton 3.6 that schedule stays at 0.89-0.95x cuDNN. Gluon
(`triton.experimental.gluon`, Triton's lower-level dialect) exposes what FA3 is built from, and this layer
uses it:

* producer / consumer warp specialisation (FA3 §3.1): a producer warp (`_loader`) issues the TMA loads of
  Q and of every K and V tile into `STAGES`-deep rings in shared memory, each slot guarded by a "ready"
  mbarrier (the bytes landed) and an "empty" one (both consumers are done with it); two consumer
  warpgroups (`_consumer`, 64 query rows each) run the GEMMs and the softmax. `gl.warp_specialize` gives
  each its own warps and register budget (setmaxnreg: 232 for a consumer, 40 for the producer).
* two consumer warpgroups that are separate partitions, each at its own pace: no CTA-wide barrier ties
  them, so one's softmax runs while the other's GEMMs hold the tensor cores (what FA3's ping-pong
  scheduling enforces with named barriers; here it arises from the two independent instruction streams).
* intra-warpgroup overlap (FA3 §3.2, Algorithm 2): in each consumer, S_j = Q K_j^T is issued, then
  O += P_{j-1} V_{j-1} behind it (`warpgroup_mma(..., is_async=True)`); the consumer waits for S_j alone
  (`warpgroup_mma_wait(1)`), computes softmax(S_j) while the P V product runs, then waits for O and
  rescales it.

The mathematics is the paper path's: online softmax in base 2 with log2(e) folded into the scale, the causal
mask on the diagonal tile only, the natural-log LSE (heads_q, total_q) the backward reads. `ws_forward` takes
and returns what `forward.attention_forward` does; `enable()` (on import) registers it for the calls
`applies` accepts (CUDA sm_90, fp16/bf16, head_dim 128 — 64 too with `enable(head_dims=(64, 128))`,
tested, −4…+6% against `hopper.py` there —, no varlen or paged K/V, seqlen_q == seqlen_k a multiple of
128, no window but the causal one, no explicit tile config) ahead of `hopper.py`'s forward, which keeps
every other call. `tools/flashattn_gluon_probe.py` times it against cuDNN, `hopper.py` and a one-partition variant.

The backward (`ws_backward`, FA2 Algorithm 2 with FA3's backward structure) runs one program per 128-key tile
K_j, V_j: a producer warp (`_bwd_loader`) lands K_j, V_j once and Q_i, dO_i of every query tile (and every
query head of a GQA group) into a ring; one 8-warp consumer partition (`_bwd_consumer`, two warpgroups of 64
key rows: both read all of dS for dQ, so they share a partition and a barrier) runs five GEMMs per step:
S^T = K_j Q_i^T and dP^T = V_j dO_i^T issued together, P^T (line 11) computed under dP^T, dV_j += P^T dO_i
and dK_j += dS^T Q_i from registers, dQ_i = dS K_j from shared memory. dK_j and dV_j stay in registers;
dQ_i's share (line 15) is staged in shared memory and added into an fp32 dQ by a TMA reduction
(cp.reduce.async.bulk.tensor .add, executed in L2): five GEMMs against the two-kernel backward's seven, no
atomics from the warps (which measured 372-408 TFLOP/s at hd128 against 398-516 for the reduction). The
consumers hold dK_j, dV_j, S^T and dP^T in registers at once; the producer warp is left 24 registers
(BWD_LOADER_REGS) so that ptxas keeps their wgmmas asynchronous. The key tiles' shares of dQ arrive in
any order, so dQ is not bit-reproducible run to run (flash-attn's default, deterministic=False);
`disable_backward()` gives the deterministic two-kernel backward back. `enable_backward()` (on import)
registers it ahead of `hopper.py`'s backward for the calls `backward_applies` accepts (the forward's shapes
at head_dim 64 / 128, dO of q's dtype). Gluon has no interpreter: the CPU tests check the
dispatch and compile both kernels for sm_90, the GPU tests the numbers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..backward import preprocess
from ..checks import cdiv
from ..dispatch import REGISTRY
from ..forward import LN2_C, LOG2E
from ..launch import is_sm90, tma_ready

try:
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

    # Triton 3.6 names the TMA copies async_copy_global_to_shared / _shared_to_global; 3.9 renamed them
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    _barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # the partition's warps (3.9: gl.barrier)
    _tma_reduce_add = getattr(tma, "async_atomic_add", None)  # Triton 3.9; 3.6 builds the op unnamed:
    if _tma_reduce_add is None:
        from triton._C.libtriton import ir as _ir
        from triton.experimental.gluon.language._core import builtin as _builtin

        @_builtin
        def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
            """global[coord:] += shared src by TMA (cp.reduce.async.bulk.tensor .add)."""
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                      src.handle)

    HAS_GLUON = True
except ImportError:  # a Triton without Gluon's Hopper module: the layer never applies
    HAS_GLUON = False

HEAD_DIMS = (64, 128)  # the kernel is written for any power-of-two head_dim; these two are tested
ENABLED_HEAD_DIMS = (128,)  # where it measured faster than hopper.py's forward (H200, 2026-12-02)
BLOCK_M = 128  # query rows per program: two consumer warpgroups of 64
BLOCK_N = 128  # key rows per K / V tile
STAGES = 2  # K / V tiles in flight per ring (3 ran 1-5% slower in the one-partition probe)
REGS = (232, 40)  # setmaxnreg of the second consumer warpgroup and of the producer warp
DTYPES = (torch.float16, torch.bfloat16)
BWD_HEAD_DIMS = (64, 128)  # the backward: the same two head_dims
BWD_BLOCK_M = 64  # query rows per backward step (its K/V tile: BLOCK_N rows)
# (Q / dO tiles in flight, dQ's GEMM issued before dK's so that dQ's reduction overlaps dK's GEMM), the best
# of stages 2 / 3 x both orders on an H200 (2026-12-02)
BWD_CONFIGS = {64: (3, True), 128: (2, False)}
# causal masks up to 4k keys at head_dim 128 (where it was measured): the grid walks groups of 4 (head, sequence) units, each group's key tiles
# heaviest first, so the short tiles fill the last wave (+3% at 4k, H200, 2026-12-02); at 16k it ran 3%
# slower (4 heads' Q, dO and fp32 dQ in flight instead of one head's), and not causal it buys nothing
BWD_HEAD_GROUP, BWD_HEAD_GROUP_UP_TO = 4, 4096
# the producer warp's registers; the two consumer warpgroups take the rest. At 40, ptxas (Triton 3.6, sm_90a)
# serialised the causal hd128 consumer's wgmmas for lack of registers (warning C7512: a wait after every
# instruction); at 24 they stay asynchronous: causal 4k / 16k 391 / 476 -> 429 / 518 TFLOP/s (H100, 2026-12-06)
BWD_LOADER_REGS = 24


if HAS_GLUON:

    @gluon.jit
    def _softmax_tile(s, m_i, l_i, qk_scale):
        """FA2 Algorithm 1, lines 9-10 for one S tile: P = exp2(S·scale − m_new), the rescale alpha, the new
        row max and row sum (base 2, log2(e) folded into qk_scale)."""
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)

    @gluon.jit
    def _mask_diagonal(s, offs_m, n0, s_layout: gl.constexpr):
        """The causal mask on the diagonal tile: key n is visible to query m when n <= m."""
        offs_n = n0 + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s_layout))
        return gl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))

    @gluon.jit
    def _consumer(q, q_bar, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, o_desc, LSE, o_row, q_col, m0,
                  n_tiles, diag_tile, lse_off, qk_scale):
        """One consumer warpgroup: the 64 query rows from m0 (its half of the program's tile: Q in `q`, landed
        on `q_bar`) against every K/V tile the producer lands (FA3 §3.2's schedule), then O / l to global
        memory by TMA at row o_row, and the LSE. Tile `diag_tile` (n_tiles when not causal: none) is masked."""
        M: gl.constexpr = 64
        dtype: gl.constexpr = q.dtype
        NUM_STAGES: gl.constexpr = k_smem.shape[0]
        TILE_N: gl.constexpr = k_smem.shape[1]
        D: gl.constexpr = k_smem.shape[2]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, TILE_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        offs_m = m0 + gl.arange(0, M, layout=row_s)
        m_i = gl.full([M], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([M], gl.float32, layout=row_s)
        s_zero = gl.zeros([M, TILE_N], gl.float32, layout=s_layout)
        o = gl.zeros([M, D], gl.float32, layout=o_layout)
        # S_0 and its softmax: the pipeline's first stage
        mbarrier.wait(q_bar, 0)
        mbarrier.wait(k_ready.index(0), 0)
        s = warpgroup_mma_wait(0, deps=(warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False,
                                                      is_async=True),))
        mbarrier.arrive(k_empty.index(0), count=1)
        if diag_tile == 0:
            s = _mask_diagonal(s, offs_m, 0, s_layout)
        p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, qk_scale)
        p_op = gl.convert_layout(p.to(dtype), p_layout)  # P stays in registers as the A operand of P V
        for j in range(1, n_tiles):
            slot = j % NUM_STAGES
            prev = (j - 1) % NUM_STAGES
            mbarrier.wait(k_ready.index(slot), (j // NUM_STAGES) & 1)
            s_tok = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(prev), ((j - 1) // NUM_STAGES) & 1)
            o_tok = warpgroup_mma(p_op, v_smem.index(prev), o, is_async=True)  # O += P_{j-1} V_{j-1}, behind S_j
            s = warpgroup_mma_wait(1, deps=(s_tok,))  # S_j has landed; the P V product may still run
            mbarrier.arrive(k_empty.index(slot), count=1)
            if j == diag_tile:
                s = _mask_diagonal(s, offs_m, j * TILE_N, s_layout)
            p, alpha, m_new, l_i = _softmax_tile(s, m_i, l_i, qk_scale)  # under the P V product
            o, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))
            mbarrier.arrive(v_empty.index(prev), count=1)
            o = o * gl.convert_layout(alpha, row_o)[:, None]  # FA2 line 10's rescale, once O has landed
            m_i = m_new
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        last = (n_tiles - 1) % NUM_STAGES
        mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // NUM_STAGES) & 1)
        o = warpgroup_mma_wait(0, deps=(warpgroup_mma(p_op, v_smem.index(last), o, is_async=True),))
        mbarrier.arrive(v_empty.index(last), count=1)
        o = o / gl.convert_layout(l_i, row_o)[:, None]  # line 12: normalise once
        gl.store(LSE + lse_off + offs_m, (m_i + gl.log2(l_i)) * LN2_C)  # line 13, natural log
        q.store(o.to(dtype))  # this half's Q is no longer read: its buffer stages O for the TMA store
        fence_async_shared()
        _tma_store(o_desc, [o_row, q_col], q)
        tma.store_wait(0)

    @gluon.jit
    def _loader(q_desc, k_desc, v_desc, q_smem, q_bar, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, row0,
                q_col, kv_col, start_m, n_tiles):
        """The producer warp (FA3 §3.1): Q's two halves, then K_j and V_j into ring slot j % STAGES once both
        consumers have released it (the empty barrier's previous phase)."""
        NUM_STAGES: gl.constexpr = k_smem.shape[0]
        TILE_N: gl.constexpr = k_smem.shape[1]
        D: gl.constexpr = k_smem.shape[2]
        tile_bytes: gl.constexpr = TILE_N * D * 2
        for half in gl.static_range(2):
            mbarrier.expect(q_bar.index(half), 64 * D * 2)
            _tma_load(q_desc, [row0 + start_m + half * 64, q_col], q_bar.index(half),
                                            q_smem.index(half))
        for j in range(n_tiles):
            slot = j % NUM_STAGES
            refill = j >= NUM_STAGES
            mbarrier.wait(k_empty.index(slot), ((j // NUM_STAGES) - 1) & 1, pred=refill)
            mbarrier.expect(k_ready.index(slot), tile_bytes)
            _tma_load(k_desc, [row0 + j * TILE_N, kv_col], k_ready.index(slot),
                                            k_smem.index(slot))
            mbarrier.wait(v_empty.index(slot), ((j // NUM_STAGES) - 1) & 1, pred=refill)
            mbarrier.expect(v_ready.index(slot), tile_bytes)
            _tma_load(v_desc, [row0 + j * TILE_N, kv_col], v_ready.index(slot),
                                            v_smem.index(slot))

    @gluon.jit
    def _ws_fwd_kernel(q_desc, k_desc, v_desc, o_desc, LSE, seqlen, group, stride_lse_h, qk_scale,
                       CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                       LOADER_REGS: gl.constexpr, num_warps: gl.constexpr):
        """One program per (128-row query tile, query head, sequence), as FA2 §3.2's grid; the shared memory
        and the barriers are made here, then the partitions fork."""
        D: gl.constexpr = q_desc.block_type.shape[1]
        TILE_N: gl.constexpr = k_desc.block_type.shape[0]
        dtype: gl.constexpr = q_desc.dtype
        pid_m = gl.program_id(0)
        if CAUSAL:  # heaviest query tiles first (FA2 §3.2)
            pid_m = gl.num_programs(0) - 1 - pid_m
        h = gl.program_id(1)
        b = gl.program_id(2)
        row0 = b * seqlen
        start_m = pid_m * 128
        n_tiles = gl.cdiv(start_m + 128, TILE_N) if CAUSAL else gl.cdiv(seqlen, TILE_N)
        q_smem = gl.allocate_shared_memory(dtype, [2, 64, D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, TILE_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, TILE_N, D], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(q_bar.index(i), count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)  # both consumers release a slot
            mbarrier.init(v_empty.index(i), count=2)
        fence_async_shared()
        lse_off = h.to(gl.int64) * stride_lse_h + row0
        diag_tile = n_tiles - 1 if CAUSAL else n_tiles  # the masked K/V tile: none when not causal
        # the two consumers differ only in their half: its Q buffer and barrier, its first row
        gl.warp_specialize([
            (_consumer, (q_smem.index(0), q_bar.index(0), k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, o_desc,
                         LSE, row0 + start_m, h * D, start_m, n_tiles, diag_tile, lse_off, qk_scale)),
            (_consumer, (q_smem.index(1), q_bar.index(1), k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, o_desc,
                         LSE, row0 + start_m + 64, h * D, start_m + 64, n_tiles, diag_tile, lse_off, qk_scale)),
            (_loader, (q_desc, k_desc, v_desc, q_smem, q_bar, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                       row0, h * D, (h // group) * D, start_m, n_tiles)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])

    @gluon.jit
    def _bwd_loader(q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, kv_bar, q_smem, do_smem, q_ready, do_ready,
                    empty, q_row0, kv_row, kv_col, q_col0, m_first, n_steps, per_head):
        """The backward's producer warp: K_j and V_j once, then Q_i and dO_i of every (query head of the group,
        query tile) step into ring slot step % STAGES once the consumers have released it."""
        NUM_STAGES: gl.constexpr = q_smem.shape[0]
        M: gl.constexpr = q_smem.shape[1]
        D: gl.constexpr = q_smem.shape[2]
        TILE_N: gl.constexpr = k_smem.shape[0]
        mbarrier.expect(kv_bar, 2 * TILE_N * D * 2)
        _tma_load(k_desc, [kv_row, kv_col], kv_bar, k_smem)
        _tma_load(v_desc, [kv_row, kv_col], kv_bar, v_smem)
        for step in range(n_steps):
            slot = step % NUM_STAGES
            row = q_row0 + (m_first + step % per_head) * M
            col = q_col0 + (step // per_head) * D
            mbarrier.wait(empty.index(slot), ((step // NUM_STAGES) - 1) & 1, pred=step >= NUM_STAGES)
            mbarrier.expect(q_ready.index(slot), M * D * 2)
            _tma_load(q_desc, [row, col], q_ready.index(slot), q_smem.index(slot))
            mbarrier.expect(do_ready.index(slot), M * D * 2)
            _tma_load(do_desc, [row, col], do_ready.index(slot), do_smem.index(slot))

    @gluon.jit
    def _bwd_consumer(k_smem, v_smem, kv_bar, q_smem, do_smem, q_ready, do_ready, empty, ds_smem, dq_smem, dq_desc,
                      dk_desc, dv_desc, LSE2, Delta, q_row0, kv_row, kv_col, qh0, n0, m_first, n_steps, per_head,
                      stride_lse_h, qk_scale, scale, CAUSAL: gl.constexpr, DQ_FIRST: gl.constexpr):
        """Two consumer warpgroups (one partition of 8 warps, 64 key rows each): FA2 Algorithm 2, lines 8-16, for
        K_j, V_j against every query tile the producer lands, five GEMMs per step. dQ_i's share (line 15) leaves
        through shared memory as a TMA reduction (FA3 appendix B.1: cp.reduce.async.bulk adds it into the fp32
        dQ in L2, no atomics from the warps); dK_j, dV_j stay in registers and leave by TMA at the end."""
        NUM_STAGES: gl.constexpr = q_smem.shape[0]
        M: gl.constexpr = q_smem.shape[1]
        D: gl.constexpr = q_smem.shape[2]
        TILE_N: gl.constexpr = k_smem.shape[0]
        dtype: gl.constexpr = q_smem.dtype
        # S^T and dP^T (keys x queries) and dK, dV (keys x head_dim): the warpgroups split the key rows;
        # dQ (queries x head_dim): they split the head_dim columns, each reading all of dS
        st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                            instr_shape=[16, M, 16])
        kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                            instr_shape=[16, D, 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                            instr_shape=[16, D // 2, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
        offs_key = n0 + gl.arange(0, TILE_N, layout=gl.SliceLayout(1, st_layout))
        offs_q = gl.arange(0, M, layout=gl.SliceLayout(0, st_layout))
        zero_st = gl.zeros([TILE_N, M], gl.float32, layout=st_layout)
        zero_dq = gl.zeros([M, D], gl.float32, layout=dq_layout)
        dk = gl.zeros([TILE_N, D], gl.float32, layout=kv_layout)
        dv = gl.zeros([TILE_N, D], gl.float32, layout=kv_layout)
        mbarrier.wait(kv_bar, 0)
        for step in range(n_steps):
            slot = step % NUM_STAGES
            phase = (step // NUM_STAGES) & 1
            m0 = (m_first + step % per_head) * M
            qh = qh0 + step // per_head
            q_tile = q_smem.index(slot)
            do_tile = do_smem.index(slot)
            mbarrier.wait(q_ready.index(slot), phase)
            st_tok = warpgroup_mma(k_smem, q_tile.permute((1, 0)), zero_st, use_acc=False, is_async=True)  # S^T
            lse_at = qh.to(gl.int64) * stride_lse_h + q_row0 + m0
            lse2 = gl.load(LSE2 + lse_at + offs_q)
            delta = gl.load(Delta + lse_at + offs_q)
            mbarrier.wait(do_ready.index(slot), phase)
            dpt_tok = warpgroup_mma(v_smem, do_tile.permute((1, 0)), zero_st, use_acc=False, is_async=True)  # dP^T
            st = warpgroup_mma_wait(1, deps=(st_tok,))  # S^T = K_j Q_i^T (line 10, transposed)
            pt = gl.exp2(st * qk_scale - lse2[None, :])  # line 11: P^T, from the forward's L (base 2)
            if CAUSAL and m0 < n0 + TILE_N:  # a tile on the diagonal: key n is visible to query m when n <= m
                pt = gl.where(offs_key[:, None] <= (m0 + offs_q)[None, :], pt, 0.0)
            pt_lo = pt.to(dtype)
            dv_tok = warpgroup_mma(gl.convert_layout(pt_lo, a_layout), do_tile, dv, is_async=True)  # line 12
            dpt = warpgroup_mma_wait(1, deps=(dpt_tok,))
            ds_lo = (pt * (dpt - delta[None, :])).to(dtype)  # line 14: dS = P o (dP - D)
            ds_op = gl.convert_layout(ds_lo, a_layout)
            if not DQ_FIRST:
                dk_tok = warpgroup_mma(ds_op, q_tile, dk, is_async=True)  # line 16
            ds_buf = ds_smem.index(step % 2)
            ds_buf.store(ds_lo)  # dQ's A operand: each warpgroup reads both halves
            fence_async_shared()
            tma.store_wait(0)  # the previous step's dQ reduction has read dq_smem
            _barrier()  # both halves written; both warpgroups are past the previous step
            mbarrier.arrive(empty.index((step + NUM_STAGES - 1) % NUM_STAGES), pred=step > 0)
            dq_tok = warpgroup_mma(ds_buf.permute((1, 0)), k_smem, zero_dq, use_acc=False, is_async=True)
            if DQ_FIRST:
                dk_tok = warpgroup_mma(ds_op, q_tile, dk, is_async=True)  # line 16, under dQ's way out
                dv, dq = warpgroup_mma_wait(1, deps=(dv_tok, dq_tok))
            else:
                dv, dk, dq = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok))
            dq_smem.store(dq * scale)  # line 15: dQ_i += dS_ij K_j, summed over key tiles in L2
            fence_async_shared()
            _barrier()
            _tma_reduce_add(dq_desc, [q_row0 + m0, qh * D], dq_smem)
            if DQ_FIRST:
                dk, ds_op = warpgroup_mma_wait(0, deps=(dk_tok, ds_op))
        tma.store_wait(0)
        _barrier()  # both warpgroups are done reading K_j and V_j: their buffers stage dK_j and dV_j
        k_smem.store((dk * scale).to(dtype))
        v_smem.store(dv.to(dtype))
        fence_async_shared()
        _barrier()
        _tma_store(dk_desc, [kv_row, kv_col], k_smem)
        _tma_store(dv_desc, [kv_row, kv_col], v_smem)
        tma.store_wait(0)

    @gluon.jit
    def _ws_bwd_kernel(q_desc, do_desc, k_desc, v_desc, dq_desc, dk_desc, dv_desc, LSE2, Delta, seqlen, group,
                       stride_lse_h, qk_scale, scale, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr,
                       LOADER_REGS: gl.constexpr, DQ_FIRST: gl.constexpr, HEAD_GROUP: gl.constexpr,
                       num_warps: gl.constexpr):
        """One program per (128-row key tile, K/V head, sequence), FA2 Algorithm 2's outer loop; the query heads
        of a GQA group run one after another in it, so dK_j and dV_j are summed in registers."""
        M: gl.constexpr = q_desc.block_type.shape[0]
        D: gl.constexpr = q_desc.block_type.shape[1]
        TILE_N: gl.constexpr = k_desc.block_type.shape[0]
        dtype: gl.constexpr = q_desc.dtype
        # the key tile is the fast grid axis: the programs running together share a few heads, whose Q, dO and
        # fp32 dQ stay in L2 (heads as the fast axis, a longest-first order for causal masks, ran 5-20% slower)
        if HEAD_GROUP == 0:  # (key tile, K/V head, sequence)
            hk = gl.program_id(1)
            row0 = gl.program_id(2) * seqlen
            n0 = gl.program_id(0) * TILE_N
        else:  # groups of HEAD_GROUP (head, sequence) units; within one, key tiles heaviest first for all units
            n_tiles = gl.num_programs(0)
            units = gl.num_programs(1) * gl.num_programs(2)
            pid = gl.program_id(0) + n_tiles * (gl.program_id(1) + gl.num_programs(1) * gl.program_id(2))
            base = (pid // (HEAD_GROUP * n_tiles)) * HEAD_GROUP
            size = gl.minimum(units - base, HEAD_GROUP)
            r = pid - base * n_tiles
            unit = base + r % size
            hk = unit % gl.num_programs(1)
            row0 = (unit // gl.num_programs(1)) * seqlen
            n0 = (r // size) * TILE_N
        m_first = n0 // M if CAUSAL else 0  # causal: query tiles above the diagonal see none of these keys
        per_head = seqlen // M - m_first
        k_smem = gl.allocate_shared_memory(dtype, [TILE_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [TILE_N, D], k_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, M, D], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, M, D], q_desc.layout)
        ds_smem = gl.allocate_shared_memory(dtype, [2, TILE_N, M],
                                            gl.NVMMASharedLayout.get_default_for([TILE_N, M], dtype))
        dq_smem = gl.allocate_shared_memory(gl.float32, [M, D], dq_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        do_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(do_ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        fence_async_shared()
        kv_row = row0 + n0
        n_steps = group * per_head
        gl.warp_specialize([
            (_bwd_consumer, (k_smem, v_smem, kv_bar, q_smem, do_smem, q_ready, do_ready, empty, ds_smem, dq_smem,
                             dq_desc, dk_desc, dv_desc, LSE2, Delta, row0, kv_row, hk * D, hk * group, n0, m_first,
                             n_steps, per_head, stride_lse_h, qk_scale, scale, CAUSAL, DQ_FIRST)),
            (_bwd_loader, (q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, kv_bar, q_smem, do_smem, q_ready,
                           do_ready, empty, row0, kv_row, hk * D, hk * group * D, m_first, n_steps, per_head)),
        ], [1], [LOADER_REGS])


def ws_forward(q, k, v, batch, seqlen_q, seqlen_k, cu_seqlens_q, cu_seqlens_k, block_table, scale, window_left,
               window_right, config=None):
    """FA2 Algorithm 1 with FA3's warp specialisation; the arguments and results of
    `forward.attention_forward` for the calls `applies` accepts (out, and the natural-log LSE as
    (heads_q, total_q) fp32)."""
    if not applies(q, k, v, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, block_table=block_table, window_left=window_left,
                   window_right=window_right, config=config):
        raise ValueError(f"ws_forward: q {tuple(q.shape)} {q.dtype} on {q.device}: takes dense sm_90 fp16/bf16 "
                         f"batches at head_dim {HEAD_DIMS} with seqlen_q == seqlen_k a multiple of 128 and no "
                         "window but the causal one (hopper_ws.applies)")
    total, heads_q, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(heads_q, total, dtype=torch.float32, device=q.device)
    if total == 0:
        return out, lse
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    q_layout = gl.NVMMASharedLayout.get_default_for([64, d], gdt)
    kv_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, d], gdt)
    q_desc = TensorDescriptor.from_tensor(q.view(total, -1), [64, d], q_layout)
    o_desc = TensorDescriptor.from_tensor(out.view(total, -1), [64, d], q_layout)
    k_desc = TensorDescriptor.from_tensor(k.view(k.shape[0], -1), [BLOCK_N, d], kv_layout)
    v_desc = TensorDescriptor.from_tensor(v.view(v.shape[0], -1), [BLOCK_N, d], kv_layout)
    _ws_fwd_kernel[(cdiv(seqlen_q, BLOCK_M), heads_q, batch)](
        q_desc, k_desc, v_desc, o_desc, lse, seqlen_q, heads_q // k.shape[1], lse.stride(0), scale * LOG2E,
        CAUSAL=window_right == 0, NUM_STAGES=STAGES, CONSUMER_REGS=REGS[0], LOADER_REGS=REGS[1], num_warps=4)
    return out, lse


def ws_backward(do, q, k, v, out, lse, batch, seqlen_q, seqlen_k, cu_seqlens_q, cu_seqlens_k, scale, window_left,
                window_right, config=None):
    """FA2 Algorithm 2 with FA3's warp specialisation and dQ summed by TMA reductions (5 GEMMs per pair of
    tiles, not the paper path's 7); the arguments and results (dq, dk, dv) of `backward.attention_backward`
    for the calls `backward_applies` accepts. config: (Q / dO stages 2 or 3, dQ's GEMM first[, head group]),
    default BWD_CONFIGS and BWD_HEAD_GROUP's rule."""
    if config is not None and not (isinstance(config, tuple) and len(config) in (2, 3) and config[0] in (2, 3)
                                   and isinstance(config[1], bool)
                                   and (len(config) == 2 or (isinstance(config[2], int) and config[2] >= 0))):
        raise ValueError(f"config must be (stages 2 or 3, dq_first bool[, head_group int]) or None, got {config!r}")
    if not backward_applies(q, k, v, do, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, window_left=window_left,
                            window_right=window_right):
        raise ValueError(f"ws_backward: q {tuple(q.shape)} {q.dtype} on {q.device}: takes dense sm_90 fp16/bf16 "
                         f"batches at head_dim {BWD_HEAD_DIMS} with seqlen_q == seqlen_k a multiple of 128, no "
                         "window but the causal one, and dO of q's dtype (hopper_ws.backward_applies)")
    total, heads_q, d = q.shape
    heads_k = k.shape[1]
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # line 15's sums, over key tiles
    if total == 0:
        return dq_acc.to(q.dtype), dk.zero_(), dv.zero_()
    do, delta, lse2 = preprocess(do, q, out, lse)  # line 4: D = rowsum(dO o O), and L in base 2
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    q_layout = gl.NVMMASharedLayout.get_default_for([BWD_BLOCK_M, d], gdt)
    kv_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, d], gdt)
    q_desc = TensorDescriptor.from_tensor(q.view(total, -1), [BWD_BLOCK_M, d], q_layout)
    do_desc = TensorDescriptor.from_tensor(do.view(total, -1), [BWD_BLOCK_M, d], q_layout)
    k_desc, v_desc, dk_desc, dv_desc = (TensorDescriptor.from_tensor(t.view(t.shape[0], -1), [BLOCK_N, d], kv_layout)
                                        for t in (k, v, dk, dv))
    dq_desc = TensorDescriptor.from_tensor(dq_acc.view(total, -1), [BWD_BLOCK_M, d],
                                           gl.NVMMASharedLayout.get_default_for([BWD_BLOCK_M, d], gl.float32))
    stages, dq_first = (config or BWD_CONFIGS[d])[:2]
    causal = window_right == 0
    head_group = (config[2] if config is not None and len(config) > 2
                  else BWD_HEAD_GROUP if causal and seqlen_k <= BWD_HEAD_GROUP_UP_TO and d == 128 else 0)
    _ws_bwd_kernel[(cdiv(seqlen_k, BLOCK_N), heads_k, batch)](
        q_desc, do_desc, k_desc, v_desc, dq_desc, dk_desc, dv_desc, lse2, delta, seqlen_q, heads_q // heads_k,
        lse.stride(0), scale * LOG2E, scale, CAUSAL=causal, NUM_STAGES=stages,
        LOADER_REGS=BWD_LOADER_REGS, DQ_FIRST=dq_first, HEAD_GROUP=head_group, num_warps=8)
    return dq_acc.to(q.dtype), dk, dv


def applies(q, k, v, **arguments) -> bool:
    """The calls `ws_forward` takes: a Triton with Gluon's Hopper module, CUDA sm_90, rows TMA can read
    (`launch.tma_ready`), and what `takes` accepts (`head_dims`: of HEAD_DIMS)."""
    return (HAS_GLUON and q.is_cuda and takes(q, k, v, **arguments) and is_sm90(q.device)
            and all(tma_ready(t) for t in (q, k, v)) and k.stride() == v.stride())


def takes(q, k, v, batch=1, seqlen_q=0, seqlen_k=0, cu_seqlens_q=None, cu_seqlens_k=None, block_table=None,
          window_left=0, window_right=0, config=None, head_dims=HEAD_DIMS, **arguments) -> bool:
    """The shapes the kernel is written for: fp16/bf16 q/k/v of one dtype, a head_dim of head_dims (64, 128), a
    dense batch (no
    cu_seqlens, no block table) with seqlen_q == seqlen_k a multiple of 128, no window but the causal one, no
    explicit tile config (the Triton layers' sweeps pass one)."""
    return (config is None and block_table is None and cu_seqlens_q is None and cu_seqlens_k is None
            and q.dtype in DTYPES and k.dtype == q.dtype and v.dtype == q.dtype and q.shape[-1] in head_dims
            and seqlen_q == seqlen_k and seqlen_q % BLOCK_M == 0
            and q.shape[0] == batch * seqlen_q and k.shape[0] == batch * seqlen_k
            and window_left >= seqlen_k and (window_right == 0 or window_right >= seqlen_k))


def backward_applies(q, k, v, do, **arguments) -> bool:
    """The calls `ws_backward` takes: those `applies` accepts at BWD_HEAD_DIMS, with dO of q's dtype."""
    return do.dtype == q.dtype and applies(q, k, v, head_dims=BWD_HEAD_DIMS, **arguments)


def enable(head_dims: tuple[int, ...] = ENABLED_HEAD_DIMS) -> Callable[[], None]:
    """Register `ws_forward` as the "forward" kernel for the calls `applies` accepts at `head_dims`, ahead of
    the other layers (dispatch.py's order). Returns the function that removes it; enabling again replaces
    the earlier registration."""
    if not set(head_dims) <= set(HEAD_DIMS):
        raise ValueError(f"head_dims must be of {HEAD_DIMS}, got {head_dims!r}")
    disable()
    REGISTRY.register("forward", ws_forward, functools.partial(applies, head_dims=tuple(head_dims)))
    return disable


def disable() -> None:
    REGISTRY.remove("forward", __name__)


def enabled() -> bool:
    return REGISTRY.registered("forward", __name__)


def enable_backward() -> Callable[[], None]:
    """Register `ws_backward` as the "backward" kernel for the calls `backward_applies` accepts, ahead of the
    other layers. Returns the function that removes it; enabling again replaces the earlier
    registration."""
    disable_backward()
    REGISTRY.register("backward", ws_backward, backward_applies)
    return disable_backward


def disable_backward() -> None:
    REGISTRY.remove("backward", __name__)


def backward_enabled() -> bool:
    return REGISTRY.registered("backward", __name__)


enable()  # registered on import: the forward and the backward where they apply
enable_backward()
