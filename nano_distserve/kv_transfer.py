"""KV-cache transfer between a prefill and a decode instance (DistServe, arXiv 2401.09670, §4.3 and §5).

After a prefill instance computes a prompt's K/V, the decode instance that will generate the rest *pulls*
the request's blocks into its own paged cache: it first makes room (backpressure: it pulls only when the
blocks fit), then asks for them; the prefill side copies the blocks into one contiguous buffer and sends
it. The pieces here are transport-agnostic:

* `LeaseTable`: blocks held for a transfer belong to a lease with a deadline; whoever does not hear from
  its peer in time releases them, so a slow or dead peer leaks nothing (a lease, not a promise).
* `export_blocks` / `import_blocks`: gather / scatter whole blocks of nano_vllm's cache
  (`ModelRunner.kv_cache`, shape [2, layers, blocks + 1, block_size, kv_heads, head_dim]).

The instances move the messages of nano_distserve.protocol and the exported blocks through a
`transport.Transport` (torch.distributed in `transport.DistTransport`, in memory with a simulated clock in
the tests), after checking that they share one KV geometry (`transport.handshake`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class LeaseTable:
    """Resources held on behalf of a peer (keyed by request id) until a deadline; `release` runs exactly
    once, on expiry or when the owner calls `release(key)`; `take(key)` ends a lease without releasing
    (ownership moved)."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.leases: dict[str, tuple[float, Callable[[], None]]] = {}

    def __len__(self) -> int:
        return len(self.leases)

    def __contains__(self, key: str) -> bool:
        return key in self.leases

    def grant(self, key: str, ttl_s: float, release: Callable[[], None]) -> None:
        if key in self.leases:
            raise KeyError(f"lease {key!r} already held")
        self.leases[key] = (self.clock() + ttl_s, release)

    def renew(self, key: str, ttl_s: float) -> bool:
        if key not in self.leases:
            return False
        self.leases[key] = (self.clock() + ttl_s, self.leases[key][1])
        return True

    def take(self, key: str) -> bool:
        return self.leases.pop(key, None) is not None

    def release(self, key: str) -> bool:
        lease = self.leases.pop(key, None)
        if lease is not None:
            lease[1]()
        return lease is not None

    def expire(self) -> list[str]:
        """Release every lease past its deadline; returns their keys."""
        now = self.clock()
        gone = [k for k, (deadline, _) in self.leases.items() if deadline <= now]
        for k in gone:
            self.release(k)
        return gone


def export_blocks(kv_cache: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """The K/V of whole blocks, all layers, as one contiguous [2, layers, n, block_size, heads, dim] copy
    (one message instead of 2 x layers x n small ones: §3.3: the transfer is bandwidth-bound)."""
    idx = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    return kv_cache.index_select(2, idx).contiguous()


def import_blocks(kv_cache: torch.Tensor, block_ids: list[int], blocks: torch.Tensor) -> None:
    """Scatter `export_blocks`' copy into blocks `block_ids` of this instance's cache: as bytes, so any
    cache dtype moves (index_copy_ takes no float8, an FP8 cache's, on a CPU)."""
    idx = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    kv_cache.view(torch.uint8).index_copy_(2, idx, blocks.view(torch.uint8))
