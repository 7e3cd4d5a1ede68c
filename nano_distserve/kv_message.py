"""The bytes a KV transfer moves for one request, whatever the cache's dtype (kv_transfer.py moves whole
blocks): a 16-bit or FP8 cache's blocks as `export_blocks` copies them; a KIVI cache's (nano_vllm's
`kv_cache_dtype="kivi2" | "kivi4"`) blocks of packed codes and, after them, the 16-bit keys of the
request's open key group, which live beside the blocks (`nano_vllm.kivi.KIVIPool.export_message`)."""

from __future__ import annotations

from typing import Any

import torch

from nano_distserve.kv_transfer import export_blocks, import_blocks


def export_kv(runner: Any, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """The K/V of a request's first `num_tokens` tokens, in blocks `block_ids` of `runner`'s cache."""
    pool = getattr(runner, "kv_pool", None)  # a KIVI cache's (nano_vllm.kivi.KIVIPool)
    if pool is not None:
        return pool.export_message(block_ids, num_tokens)
    return export_blocks(runner.kv_cache, block_ids)


def kv_buffer(runner: Any, num_blocks: int) -> torch.Tensor:
    """An empty receive buffer for `export_kv` of `num_blocks` blocks from an instance like `runner`."""
    cache, pool = runner.kv_cache, getattr(runner, "kv_pool", None)
    if pool is not None:
        return torch.empty(pool.message_bytes(num_blocks), dtype=torch.uint8, device=cache.device)
    return torch.empty((*cache.shape[:2], num_blocks, *cache.shape[3:]), dtype=cache.dtype,
                       device=cache.device)


def import_kv(runner: Any, block_ids: list[int], buf: torch.Tensor, num_tokens: int, seq: Any) -> None:
    """Scatter `export_kv`'s bytes into blocks `block_ids` of `runner`'s cache, for `seq`."""
    pool = getattr(runner, "kv_pool", None)
    if pool is not None:
        return pool.import_message(block_ids, buf, num_tokens, seq)
    import_blocks(runner.kv_cache, block_ids, buf)
