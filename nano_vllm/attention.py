"""PagedAttention (vLLM, arXiv 2309.06180, §4.1) as the attention call of shared.model.

The KV cache of layer l is two tensors of shape (num_blocks, block_size, kv_heads, head_dim): a pool of
fixed-size blocks ("pages"). Token j of sequence b has its key/value in block `block_table[b, j // block_size]`,
row `j % block_size` — logically contiguous, physically anywhere (§4.1, Fig. 5). Each step the backend:

1. writes the new tokens' K/V into the cache rows named by `slot_mapping` (block * block_size + offset);
2. attends each new query to *all* keys of its sequence through the block table: nano_flashattn's
   `flash_attn_varlen_func(..., block_table=)` for prefill chunks and mixed steps (causal, bottom-right
   aligned, so a chunk sees the cached prefix plus itself), `flash_attn_with_kvcache` (Flash-Decoding) for
   steps where every sequence decodes one token (§4.3). In a mixed step the leading sequences that compute
   one token (the running decodes: the scheduler puts them first) also go to the decode kernel
   (`AttentionContext.decode_lens`): the varlen kernel's query tiles are 128 rows, so a one-row query would
   pay for a whole tile's pass over its context (~7x a decode kernel's cost, measured on an 8B shape). A
   speculative step's chains of k + 1 tokens (nano_specdec) are attended the same way, a row at a time.
   On CUDA tensors these are the Triton kernels, on a CPU the torch references. A step in which no
   sequence has anything cached yet attends to the fresh K/V directly (plain varlen FlashAttention),
   skipping the page indirection, and so do a mixed step's prefills when they all start at 0
   (`AttentionContext.fresh`): with an FP8 cache that also skips widening the codes in a prefill's
   inner loop. (A step small enough for a mixed-step CUDA graph reads every key through the pages.)

Every layer writes before it reads, so within one step a sequence can read K/V that another sequence of
the same step writes (two identical prompts admitted together share their prefix blocks).

An FP8 cache (`kv_cache_dtype="fp8"`, vLLM's) holds E4M3 codes: step 1 quantizes, x -> E4M3(x / scale),
and step 2's kernels read code * scale, with one fp32 scale per layer for K and one for V. A KIVI cache
(`kv_cache_dtype="kivi2" | "kivi4"`: 2/4-bit codes) takes the same two steps in its own attention call,
nano_vllm.kivi.KIVIAttention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nano_flashattn import flash_attn_varlen_func, flash_attn_with_kvcache, store_kv_fp8
from nano_flashattn.checks import HEAD_DIMS, HEAD_DIMS_TEXT


@dataclass
class AttentionContext:
    """One step's paged-attention metadata (what the model passes to every layer as `attn_ctx`).

    slot_mapping: (num_tokens,) int64, the cache row of each new token (padding and already-cached tokens
        point at a scratch block no sequence owns).
    Decode steps (`is_decode`): q is (batch, 1); `context_lens` (batch,) int32 counts keys incl. the new one.
    Other steps: q is (1, num_tokens), packed; `cu_seqlens_q/k` (batch + 1,) int32 delimit each sequence's
    new tokens / all its keys; `block_tables` is None when nothing is cached yet (attend to k, v directly).
    decode_lens: (B,) int32 or None, in a paged mixed step: the key count of each of the first B rows of q,
        the leading sequences' (one-token decodes; a verifying runner's draft chains, a row each), 0 for
        padding. Those sequences are empty in `cu_seqlens_q` (their start is moved to their end), and the
        decode kernel attends their rows, row r through `decode_tables[r]`, its sequence's block table.
    fresh: in a mixed step, none of the other sequences had a key cached before it (whole prompts, no
        prefix hit): their keys are exactly this step's k, v, as in a step with nothing cached, and
        `cu_seqlens_k` is `cu_seqlens_q`. KIVI's prefill (§3.3) attends to the full-precision K/V too.
    """

    slot_mapping: torch.Tensor
    is_decode: bool = False
    context_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    decode_lens: torch.Tensor | None = None
    decode_tables: torch.Tensor | None = None
    fresh: bool = False


def check_head_dim(head_dim: int, device: torch.device | str = "cuda") -> None:
    """The paged kernels (nano_flashattn) tile every head_dim that is a multiple of 8 from 16 to 256. On a
    CUDA device any other head_dim is an error (the torch reference attention would run, materialising
    seqlen² scores per sequence and syncing every layer); elsewhere the engine runs that reference, which
    takes any head_dim."""
    if torch.device(device).type == "cuda" and head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported by the paged kernels on CUDA; "
                         f"supported: {HEAD_DIMS_TEXT} (a CPU engine runs any head_dim on the "
                         "torch reference)")


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V rows into the paged cache (one index_copy_ each: CUDA-graph safe, no sync)."""
    heads, dim = k_cache.shape[-2:]
    k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, k.reshape(-1, heads, dim))
    v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, v.reshape(-1, heads, dim))


class PagedAttention:
    """The `attn_fn(q, k, v, layer_idx, ctx)` installed with `model.set_attention`; owns no state but a
    view of the KV cache, shape (2, num_layers, num_blocks, block_size, kv_heads, head_dim), and for an
    FP8 cache its scales, shape (2, num_layers, 1): K's and V's of each layer."""

    def __init__(self, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None = None):
        self.kv_cache, self.kv_scales = kv_cache, kv_scales

    def scales(self, layer_idx: int) -> dict[str, torch.Tensor]:
        """The k_scale / v_scale keyword arguments of layer `layer_idx` (none for a 16-bit cache)."""
        if self.kv_scales is None:
            return {}
        return {"k_scale": self.kv_scales[0, layer_idx], "v_scale": self.kv_scales[1, layer_idx]}

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int,
                 ctx: AttentionContext) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache[0, layer_idx], self.kv_cache[1, layer_idx]
        if self.kv_scales is None:
            store_kvcache(k, v, k_cache, v_cache, ctx.slot_mapping)
        else:
            store_kv_fp8(k, v, k_cache, v_cache, ctx.slot_mapping, **self.scales(layer_idx))
        return self.attend(q, k, v, layer_idx, ctx)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int,
               ctx: AttentionContext) -> torch.Tensor:
        """Step 2, with this step's K/V already in the cache (`__call__` wrote them, or a fused kernel)."""
        k_cache, v_cache = self.kv_cache[0, layer_idx], self.kv_cache[1, layer_idx]
        scales = self.scales(layer_idx)
        if ctx.is_decode:  # q: (batch, 1, heads, dim); every key, the new one too, is in the cache
            return flash_attn_with_kvcache(q, k_cache, v_cache, ctx.context_lens,
                                           block_table=ctx.block_tables, causal=True, **scales)
        q0 = q[0]  # (num_tokens, heads, dim), sequences packed
        if ctx.block_tables is None or ctx.fresh:  # none cached before: the keys are exactly k, v
            out = flash_attn_varlen_func(q0, k[0], v[0], ctx.cu_seqlens_q, ctx.cu_seqlens_k,
                                         ctx.max_seqlen_q, ctx.max_seqlen_k, causal=True)
        else:
            out = flash_attn_varlen_func(q0, k_cache, v_cache, ctx.cu_seqlens_q, ctx.cu_seqlens_k,
                                         ctx.max_seqlen_q, ctx.max_seqlen_k, causal=True,
                                         block_table=ctx.block_tables, **scales)
        if ctx.decode_lens is not None:  # the leading decode rows: the decode kernel
            lens, rows = ctx.decode_lens, ctx.decode_lens.shape[0]
            dec = flash_attn_with_kvcache(q0[:rows, None], k_cache, v_cache, lens, causal=True,
                                          block_table=ctx.decode_tables, **scales)[:, 0]
            out[:rows] = torch.where((lens > 0)[:, None, None], dec, out[:rows])
        return out[None]
