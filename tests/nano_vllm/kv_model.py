"""A brute-force model of the paged KV cache for the block-manager and scheduler property tests.

The "K/V" of token p of a sequence is the tuple of its tokens 0..p (what K/V really depend on). The
model executes every write the engine would do (copy-on-write copies, then the step's new tokens at the
slots the block table gives) and checks that every read the attention would do finds the right content:
a prefix-cache hit on a wrong or never-computed block, a write into a block someone else reads, or a
lost copy all show up as a mismatch.
"""

from __future__ import annotations

from collections import Counter

from nano_vllm.block_manager import BlockManager, PrefixCache
from nano_vllm.sequence import Sequence


class KVModel:
    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.bs = bm.block_size
        self.slots: dict[int, list[tuple | None]] = {b: [None] * self.bs for b in range(bm.num_blocks)}

    def copy(self, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:
            self.slots[dst] = list(self.slots[src])

    def write(self, seq: Sequence, start: int, end: int) -> None:
        """The step computes tokens [start, end); rows already cached are not rewritten (engine rule)."""
        for p in range(max(start, seq.num_cached_tokens), end):
            self.slots[seq.block_table[p // self.bs]][p % self.bs] = tuple(seq.token_ids[: p + 1])

    def check_reads(self, seq: Sequence, end: int) -> None:
        """What attention reads for a query at position end-1: rows 0..end-1 through the block table."""
        for p in range(end):
            got = self.slots[seq.block_table[p // self.bs]][p % self.bs]
            assert got == tuple(seq.token_ids[: p + 1]), f"seq {seq.seq_id} position {p}: stale or foreign K/V"

    def check_invariants(self, live: list[Sequence]) -> None:
        bm, pool = self.bm, self.bm.pool
        refs = Counter(b for s in live for b in s.block_table)
        for b in range(bm.num_blocks):
            assert pool.ref_counts[b] == refs.get(b, 0), f"block {b}: ref {pool.ref_counts[b]} != {refs.get(b, 0)}"
            assert (b in pool.free) == (pool.ref_counts[b] == 0), f"block {b}: free list disagrees with ref"
        assert bm.num_free_blocks == bm.num_blocks - len(refs)
        for s in live:
            assert len(s.block_table) == bm.blocks_for(s.num_computed_tokens), s
            self.check_reads(s, s.num_computed_tokens)
        cache = bm.cache
        if cache is None:
            return
        for h, b in cache.hash_to_block.items():
            info = cache.block_info[b]
            assert info[0] == h
            # A hashed block holds exactly the tokens it was hashed with, after the prefix its parent hash names.
            content = self.slots[b]
            assert all(c is not None for c in content), f"hashed block {b} was never fully written"
            assert tuple(c[-1] for c in content) == info[1][1]
            prefix, parent = content[0][:-1], None
            for i in range(len(prefix) // self.bs):
                parent = PrefixCache.block_hash(parent, prefix[i * self.bs : (i + 1) * self.bs])
            assert parent == info[1][0], f"block {b} is chained to the wrong parent"
