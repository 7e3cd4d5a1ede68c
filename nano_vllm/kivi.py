"""KIVI's 2- and 4-bit KV cache in the engine: `kv_cache_dtype="kivi2" | "kivi4"` (Liu et al., ICML 2024,
arXiv 2402.02750; nano_quant.kv is its torch specification, nano_flashattn.kivi the paged layout).

The block pool (`KIVIPool.kv_cache`) is one uint8 tensor (2, layers, num_blocks + 1, block_size, kv_heads,
width), the 16-bit pool's shape with each (token, head) row holding `width` bytes: the token's packed codes
and its share of the fp16 scales and zeros (keys per channel over groups of G tokens, values per token over
groups of G channels). Byte-level block operations need nothing new: copy-on-write (`copy_blocks`) and
nano_distserve's transfer move a block's bytes as they are, and a prefix hit shares quantized blocks.

The residual (KIVI §3.3): a key group is quantized once its G tokens are written, so each sequence's last,
not yet full group (up to G - 1 keys) stays in 16 bits, in `k_tail` (layers, entries + 1, G, kv_heads,
head_dim), entry `tail_of_block[block]` of the block that holds the group; values are quantized as they
are written, so a block's bytes depend on its tokens alone: a prefix hit, a chunked prefill, a one-shot
prefill and a preempted sequence's recomputation write the same bytes. KIVI's window of the newest
R = 128 tokens (`kv_cache_residual`) is kept beside the blocks, not in them: each sequence writes its new
K and V also into a 16-bit ring of its own (`k_win`, `v_win`: layers, entries + 1, rows, kv_heads,
head_dim; rows = R + G - 1 rounded to whole groups), and a decode reads its newest values (from L - R)
and keys (from the group holding position L - R) from the ring (`nano_flashattn.kivi.KIVIWindow`):
nano_quant.kv's KIVICache, as KIVI decodes; a prefill step over cached pages reads the same rings over
its dequantized pages. Tokens a sequence did not write itself (a prefix hit) are read from their codes.

Host bookkeeping, each step (`plan`, from `ModelRunner.prepare`): each sequence's ring entry and the
first position it holds (`plan_window`; a recomputed sequence starts again); the block that holds a
sequence's open group after the step gets a tail entry — the sequence's entry follows its open group from block to block,
a new one when it opens a group, freed when the step closes it; a copy-on-write copy of a block takes a new
entry holding a copy of the source's rows. Entries whose sequence finished, was aborted or preempted are
reclaimed when the free ones run out. `apply` (from `ModelRunner.run`, before the forward) uploads the
changed map entries and copies those rows, in stream order. One device only (the tensor-parallel workers
would not see the bookkeeping).

Attention (`KIVIAttention`, the model's attention call): write K/V (`store_kv_kivi`: the Triton kernels on
CUDA, torch elsewhere), then read: decode steps and a mixed step's leading decodes through
`flash_attn_with_kivi_cache` (Flash-Decoding over the packed blocks, dequantized in registers); a prefill
step over cached keys (a chunked prefill's later chunks, a prefix hit, a recomputation) dequantizes its
sequences' pages into a 16-bit copy (`dequantize_kivi_pages`) for the 16-bit paged prefill kernel; a step
with nothing cached attends to its fresh K/V, as in the 16-bit engine, and so do a mixed step's prefills
when they all start at 0 (`AttentionContext.fresh`): KIVI's prefill (§3.3) attends to the full-precision
K/V, and no page of theirs is dequantized.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch

from nano_flashattn import flash_attn_varlen_func
from nano_flashattn.kivi import (
    KIVILayout,
    KIVIWindow,
    check_kivi_spec,
    dequantize_kivi_pages,
    flash_attn_with_kivi_cache,
    overlay_window,
    store_kv_kivi,
    store_kv_window,
)
from nano_vllm.attention import AttentionContext
from nano_vllm.config import KIVI_BITS, EngineConfig
from nano_vllm.sequence import SequenceStatus
from shared.config import ModelConfig

NO_WINDOW = 2**31 - 1  # the first window position of a row with no sequence: past any length


def kivi_layout(config: EngineConfig, model_config: ModelConfig, num_kv_heads: int) -> KIVILayout:
    """The pool's geometry; a head_dim that is not a multiple of the group size is a ValueError."""
    bits, group = KIVI_BITS[config.kv_cache_dtype], config.kv_cache_group_size
    check_kivi_spec(bits, group, model_config.head_dim, config.block_size)
    return KIVILayout(bits, group, config.block_size, num_kv_heads, model_config.head_dim)


def kivi_tail_bytes(config: EngineConfig, model_config: ModelConfig, num_kv_heads: int) -> int:
    """Bytes of the 16-bit residual: one entry of G keys per sequence (max_num_seqs + a scratch entry),
    and with a window (kv_cache_residual R) one entry of R + G keys and values per sequence, every
    layer, in the model's dtype."""
    lay = kivi_layout(config, model_config, num_kv_heads)
    entries = config.max_num_seqs + 1
    rows = lay.group_size + (2 * window_rows(config, lay) if config.kv_cache_residual else 0)
    return (model_config.num_hidden_layers * entries * rows * num_kv_heads * lay.head_dim
            * config.torch_dtype.itemsize)


def window_rows(config: EngineConfig, lay: KIVILayout) -> int:
    """Rows of a sequence's window ring: R values, and keys back to the start of the group holding the
    R-th newest (R + G - 1), rounded up to whole groups."""
    G = lay.group_size
    return -(-(config.kv_cache_residual + G - 1) // G) * G


class KIVIPool:
    """The KIVI block pool of one runner, its 16-bit residual and the residual's bookkeeping."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, num_kv_heads: int,
                 num_blocks: int, device: torch.device):
        self.layout = lay = kivi_layout(config, model_config, num_kv_heads)
        self.bits, self.group_size, self.block_size = lay.bits, lay.group_size, lay.block_size
        layers, self.device = model_config.num_hidden_layers, device
        self.kv_cache = torch.zeros(2, layers, num_blocks + 1, lay.block_size, num_kv_heads, lay.width,
                                    dtype=torch.uint8, device=device)
        self.num_entries = config.max_num_seqs  # entry num_entries: scratch (padding, cached tokens)
        self.k_tail = torch.zeros(layers, self.num_entries + 1, lay.group_size, num_kv_heads,
                                  lay.head_dim, dtype=config.torch_dtype, device=device)
        self.tail_of_block = torch.full((num_blocks + 1,), self.num_entries, dtype=torch.int32,
                                        device=device)
        self.entry_of: dict[int, int] = {}  # block -> entry, for blocks that hold an open group
        self.owners: dict[int, weakref.WeakSet] = {}  # entry -> sequences seen with it open
        self.free = list(range(self.num_entries - 1, -1, -1))
        self.updates: dict[int, int] = {}  # block -> entry, not yet on the device
        self.copies: list[tuple[int, int]] = []  # (src, dst) entries, not yet copied
        # KIVI's window (kv_cache_residual R): a ring of 16-bit K and V per sequence, entry num_entries
        # scratch; this step's entry and first held position per sequence row, ring row per token row
        self.residual = config.kv_cache_residual
        if self.residual:
            self.rows = rows = window_rows(config, lay)
            shape = (layers, self.num_entries + 1, rows, num_kv_heads, lay.head_dim)
            self.k_win = torch.zeros(shape, dtype=config.torch_dtype, device=device)
            self.v_win = torch.zeros_like(self.k_win)
            # rows 0 and 1: each sequence row's entry and first held position, uploaded together
            self.win_meta = torch.tensor([[self.num_entries], [NO_WINDOW]], dtype=torch.int32,
                                         device=device).repeat(1, self.num_entries)
            self.win_entry, self.win_start = self.win_meta
            self.win_slot = torch.full((config.max_num_batched_tokens,), self.num_entries * rows,
                                       dtype=torch.long, device=device)
            self.win_held: dict[int, list] = {}  # seq_id -> [entry, start, next position, seq]
            self.win_free = list(range(self.num_entries - 1, -1, -1))

    @property
    def tail_bytes(self) -> int:
        extra = self.k_win.nbytes + self.v_win.nbytes if self.residual else 0
        return self.k_tail.nbytes + self.tail_of_block.nbytes + extra

    def window(self, layer_idx: int, rows: slice) -> KIVIWindow | None:
        """Layer `layer_idx`'s KIVIWindow for the step's sequence rows `rows` (None without one)."""
        if not self.residual:
            return None
        return KIVIWindow(self.k_win[layer_idx], self.v_win[layer_idx], self.win_entry[rows],
                          self.win_start[rows], self.residual)

    def plan_window(self, out: Any) -> None:
        """Each scheduled sequence's window entry and first held position (a new entry, and the
        positions from the first it writes, when it is new or restarts after preemption), and the ring
        row of every token row this step writes (scratch for cached tokens and for those the ring's
        newest `rows` positions leave out); uploaded before the forward."""
        rows, scratch = self.rows, self.num_entries * self.rows
        entries, starts, slots = [], [], []
        for seq, n in zip(out.seqs, out.num_new_tokens):
            begin = seq.num_computed_tokens
            first, end = max(begin, seq.num_cached_tokens), begin + n
            held = self.win_held.get(seq.seq_id)
            if held is None or begin < held[2]:  # new, or recomputed after preemption
                entry = held[0] if held is not None else self._take_window()
                held = self.win_held[seq.seq_id] = [entry, first, first, weakref.ref(seq)]
            held[2] = end
            entries.append(held[0])
            starts.append(held[1])
            if n == 1:  # a decode (hundreds a step): its one row
                slots.append(held[0] * rows + begin % rows if begin >= first else scratch)
            else:
                pos = np.arange(begin, end)
                keep = pos >= max(first, end - rows)
                slots += np.where(keep, held[0] * rows + pos % rows, scratch).tolist()
        pad = self.num_entries - len(entries)
        self.win_meta.copy_(self._upload([entries + [self.num_entries] * pad,
                                          starts + [NO_WINDOW] * pad], torch.int32))
        slots += [scratch] * (self.num_entries - len(slots))  # a decode graph's padded rows
        self.win_slot[: len(slots)].copy_(self._upload(slots, torch.long))

    def _take_window(self) -> int:
        if not self.win_free:  # reclaim the entries of sequences no longer running
            for seq_id, held in list(self.win_held.items()):
                seq = held[3]()
                if seq is None or seq.status is not SequenceStatus.RUNNING:
                    self.win_free.append(self.win_held.pop(seq_id)[0])
        if not self.win_free:
            raise RuntimeError(f"the KIVI window has no free entry ({self.num_entries} entries, one per "
                               "sequence of max_num_seqs)")
        return self.win_free.pop()

    # ------------------------------------------------------------------ host bookkeeping
    def plan(self, out: Any) -> None:
        """The tail entries this step's writes use (a `SchedulerOutput`: seqs, num_new_tokens, copies),
        on the device before the step runs (`apply`)."""
        G, bs = self.group_size, self.block_size
        for src, dst in out.copies:  # copy-on-write: the copy's open group needs the source's rows
            if src in self.entry_of:
                entry = self._take()
                self.copies.append((self.entry_of[src], entry))
                self._open(dst, entry, None)
        for seq, n in zip(out.seqs, out.num_new_tokens):
            first, end = max(seq.num_computed_tokens, seq.num_cached_tokens), seq.num_computed_tokens + n
            if first >= end:  # a fully cached prompt's last token: recomputed, not written
                continue
            if first % G and end - first < G - first % G:
                continue  # the step stays inside the open group (most decodes): its entry stays put
            table, entry = seq.block_table, None
            if first % G:  # the step continues an open group: its older keys are in the tail
                block = table[(first - first % G) // bs]
                entry = self.entry_of.pop(block, None)
                if entry is None:
                    raise RuntimeError(f"sequence {seq.seq_id}: block {block} holds an open key group "
                                       "but no residual entry")
            if end % G == 0:  # the step closes its last group: nothing stays in 16 bits
                if entry is not None:
                    self._release(entry)
                continue
            block = table[(end - end % G) // bs]
            stale = self.entry_of.pop(block, None)  # left by a sequence that freed the block
            if entry is None:
                entry = self._take() if stale is None else stale
            elif stale is not None and stale != entry:
                self._release(stale)
            self._open(block, entry, seq)
        if self.residual:
            self.plan_window(out)
        self.apply()  # in stream order: before this step's forward, after the last one's

    def _open(self, block: int, entry: int, seq: Any) -> None:
        self.entry_of[block] = entry
        self.updates[block] = entry
        owners = self.owners.setdefault(entry, weakref.WeakSet())
        if seq is not None:
            owners.add(seq)

    def _take(self) -> int:
        if not self.free:
            self._reclaim()
        if not self.free:
            raise RuntimeError(f"the KIVI residual has no free entry ({self.num_entries} entries, one "
                               "per sequence of max_num_seqs)")
        return self.free.pop()

    def _release(self, entry: int) -> None:
        self.owners.pop(entry, None)
        self.free.append(entry)

    def _reclaim(self) -> None:
        """Free the entries of blocks no running sequence holds open (finished, aborted, preempted);
        not those this step's plan has opened so far (a copy-on-write copy's holder may come later)."""
        for block, entry in list(self.entry_of.items()):
            if block in self.updates:
                continue
            owners = self.owners.get(entry, ())
            if not any(s.status is SequenceStatus.RUNNING and block in s.block_table for s in owners):
                del self.entry_of[block]
                self._release(entry)

    def apply(self) -> None:
        """Upload the map entries `plan` changed and copy the copy-on-write rows (before the forward)."""
        if self.updates:
            blocks = self._upload(list(self.updates), torch.long)
            self.tail_of_block.index_copy_(0, blocks, self._upload(list(self.updates.values()),
                                                                   torch.int32))
            self.updates = {}
        if self.copies:
            src = self._upload([s for s, _ in self.copies], torch.long)
            dst = self._upload([d for _, d in self.copies], torch.long)
            self.k_tail[:, dst] = self.k_tail[:, src]
            self.copies = []

    def _upload(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        """Host ints on the device without a sync: through pinned memory on CUDA (with overlapped
        scheduling the device is still running the previous step)."""
        host = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ a sequence's blocks, for transfers
    def message_bytes(self, num_blocks: int) -> int:
        """Bytes of `export_message` for `num_blocks` blocks."""
        per_block = self.kv_cache[:, :, 0].numel()
        return num_blocks * per_block + self.k_tail[:, 0].numel() * self.k_tail.element_size()

    def export_message(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """A sequence's blocks, K/V of its first `num_tokens` tokens, as one flat uint8 tensor: the
        blocks' bytes (2, layers, n, block_size, heads, width), then the 16-bit keys of its open group
        (layers, G, heads, head_dim; zeros when `num_tokens` closes its last group)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        blocks = self.kv_cache.index_select(2, idx)
        G, n = self.group_size, num_tokens
        entry = self.entry_of.get(block_ids[(n - n % G) // self.block_size], self.num_entries) \
            if n % G else self.num_entries
        tail = self.k_tail[:, entry] if n % G else torch.zeros_like(self.k_tail[:, 0])
        return torch.cat([blocks.reshape(-1), tail.contiguous().view(torch.uint8).reshape(-1)])

    def import_message(self, block_ids: list[int], message: torch.Tensor, num_tokens: int,
                       seq: Any) -> None:
        """Write `export_message`'s bytes into blocks `block_ids` of this pool; the open group's keys
        take a residual entry, held by `seq`."""
        n = len(block_ids)
        cut = self.message_bytes(n) - self.k_tail[:, 0].numel() * self.k_tail.element_size()
        shape = (*self.kv_cache.shape[:2], n, *self.kv_cache.shape[3:])
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        self.kv_cache.index_copy_(2, idx, message[:cut].view(shape))
        G, bs = self.group_size, self.block_size
        if num_tokens % G:
            block = block_ids[(num_tokens - num_tokens % G) // bs]
            entry = self.entry_of.pop(block, None)
            entry = self._take() if entry is None else entry
            self._open(block, entry, seq)
            self.apply()
            rows = message[cut:].view(self.k_tail.dtype).view(self.k_tail[:, 0].shape)
            self.k_tail[:, entry] = rows


class KIVIAttention:
    """The `attn_fn(q, k, v, layer_idx, ctx)` of a KIVI engine (module docstring). `kv_cache` is the
    uint8 pool, so the layers that write 16-bit K/V themselves (fused RoPE + store, the fused decoder
    layer) see a cache not of q's dtype and leave the step to this call."""

    def __init__(self, pool: KIVIPool):
        self.pool, self.kv_cache = pool, pool.kv_cache

    def caches(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.kv_cache[0, layer_idx], self.kv_cache[1, layer_idx], self.pool.k_tail[layer_idx]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int,
                 ctx: AttentionContext) -> torch.Tensor:
        p = self.pool
        store_kv_kivi(k, v, *self.caches(layer_idx), ctx.slot_mapping, p.tail_of_block, p.bits,
                      p.group_size)
        if p.residual:  # and every new row into its sequence's window ring
            store_kv_window(k, v, p.window(layer_idx, slice(None)), p.win_slot[: ctx.slot_mapping.numel()])
        return self.attend(q, k, v, layer_idx, ctx)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int,
               ctx: AttentionContext) -> torch.Tensor:
        p, caches = self.pool, self.caches(layer_idx)
        quant = (p.tail_of_block, p.bits, p.group_size)
        if ctx.is_decode:  # q: (batch, 1, heads, dim)
            return flash_attn_with_kivi_cache(q, *caches, ctx.context_lens, ctx.block_tables, *quant,
                                              causal=True,
                                              window=p.window(layer_idx, slice(0, q.shape[0])))
        q0 = q[0]
        lead = 0 if ctx.decode_lens is None else ctx.decode_lens.shape[0]  # the decodes: below
        if ctx.block_tables is None or ctx.fresh:  # nothing cached before: the keys are exactly k, v
            # (KIVI §3.3: a prefill attends to its full-precision K/V; only the cache holds codes)
            out = flash_attn_varlen_func(q0, k[0], v[0], ctx.cu_seqlens_q, ctx.cu_seqlens_k,
                                         ctx.max_seqlen_q, ctx.max_seqlen_k, causal=True)
        else:
            tables, cu_k = ctx.block_tables[lead:], ctx.cu_seqlens_k[lead:]
            k16, v16, pages = dequantize_kivi_pages(*caches, tables, cu_k.diff(), *quant, q.dtype)
            if p.residual:  # the newest tokens, this step's among them, from the sequences' rings
                overlay_window(k16, v16, pages, p.window(layer_idx, slice(lead, lead + tables.shape[0])),
                               cu_k.diff(), p.group_size)
            out = flash_attn_varlen_func(q0, k16, v16, ctx.cu_seqlens_q[lead:], cu_k, ctx.max_seqlen_q,
                                         ctx.max_seqlen_k, causal=True, block_table=pages)
        if lead:
            lens = ctx.decode_lens
            dec = flash_attn_with_kivi_cache(q0[:lead, None], *caches, lens, ctx.block_tables[:lead],
                                             *quant, causal=True,
                                             window=p.window(layer_idx, slice(0, lead)))[:, 0]
            out[:lead] = torch.where((lens > 0)[:, None, None], dec, out[:lead])
        return out[None]


def install_kivi(runner: Any, num_blocks: int) -> None:
    """`ModelRunner.allocate_kv_cache` for a KIVI cache: the pool, its residual and the attention call."""
    runner.kv_pool = KIVIPool(runner.config, runner.model_config, runner.num_kv_heads, num_blocks,
                              runner.device)
    runner.kv_cache, runner.kv_scales = runner.kv_pool.kv_cache, None
    runner.model.set_attention(KIVIAttention(runner.kv_pool))
