"""`RadixBlockManager`: nano_vllm's block manager with RadixAttention's tree as its prefix cache (§3).

nano_vllm's `BlockManager` keeps block tables, reference counts, copy-on-write and the free list; this
subclass swaps its hash-chain prefix cache for `RadixCache` and adds what the radix tree needs:

* admission locks the matched node (and so its path to the root) *before* anything is evicted to make
  room, so a request's own prefix can never be evicted under it;
* when blocks run out, the tree evicts least-recently-used unlocked leaves before the scheduler has to
  preempt anyone — the cache and running requests share one pool and the cache shrinks first (§3);
* `cache_blocks` inserts a request's newly full blocks and *re-matches* it: where the tree already held
  the same tokens in other blocks (two requests produced the same text), the request's table is pointed
  at the tree's blocks and its duplicates go back to the pool; blocks this very step writes stay private
  until the next call (they are being written), and a finished request's leftover duplicates are freed
  with it. The request's lock moves to its new last node.

Blocks are the tree's pages: page size = `block_size` (nano_vllm's kernels want ≥ 16; the tree itself
works with any page size, see tests/nano_sglang/test_radix_cache.py).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from nano_sglang.radix_cache import RadixCache, TreeNode
from nano_sglang.sequence import SGLSequence
from nano_vllm.block_manager import BlockManager


class RadixBlockManager(BlockManager):
    """nano_vllm's block manager with the radix tree as its prefix cache (module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        super().__init__(num_blocks, block_size, enable_prefix_caching=False)  # no hash chain
        self.tree = RadixCache(self.pool, block_size)
        self.enabled = enable_prefix_caching
        self.locked: dict[int, TreeNode] = {}  # seq_id -> its locked last node
        # seq_id -> node of the last match_prefix (no lock yet)
        self.matched: dict[int, TreeNode] = {}
        self.num_evicted_blocks = 0

    # ------------------------------------------------------------------ admission
    def match_prefix(self, seq: SGLSequence) -> list[int]:
        """Pages of the longest cached prefix of `seq` (up to its cacheable tokens: a request scoring its
        prompt computes the scored tokens' logits); remembers the node for the allocation that follows."""
        if not self.enabled:
            return []
        pages, node = self.tree.match_prefix(seq.token_ids[: seq.num_cacheable_tokens])
        self.matched[seq.seq_id] = node  # an abort now leaves nothing behind: no lock is taken yet
        return pages

    def allocate_slots(self, seq: SGLSequence, num_new_tokens: int, cached_blocks: Seq[int] = (),
                       num_computed_tokens: int | None = None) -> bool:
        """nano_vllm's allocation, evicting LRU leaves of the tree when blocks run out. On admission the
        matched node is locked first, so eviction never takes the prefix the request is about to use."""
        if num_computed_tokens is None:  # a running sequence grows
            return self._allocate_evicting(seq, num_new_tokens)
        node = self.matched.pop(seq.seq_id, self.tree.root)
        if (node.parent is None and node is not self.tree.root) or \
                self.tree.path_len(node) != len(cached_blocks) * self.block_size:
            raise ValueError(f"sequence {seq.seq_id}: cached blocks do not come from its last "
                             "match_prefix")
        self.tree.lock(node)  # first: eviction below must not take the matched prefix
        if self._allocate_evicting(seq, num_new_tokens, cached_blocks, num_computed_tokens):
            self.locked[seq.seq_id] = node
            return True
        self.tree.unlock(node)
        return False

    def _allocate_evicting(self, seq: SGLSequence, n: int, cached: Seq[int] = (),
                           start: int | None = None) -> bool:
        while not super().allocate_slots(seq, n, cached, start):
            table = len(cached) if start is not None else len(seq.block_table)
            end = (start if start is not None else seq.num_computed_tokens) + n
            # +1: a copy-on-write
            short = max(self.blocks_for(end) - table + 1 - self.pool.num_free, 1)
            released = self.tree.evict(short)
            self.num_evicted_blocks += released
            if released == 0:
                return False
        return True

    # ------------------------------------------------------------------ insertion
    def cache_blocks(self, seq: SGLSequence, num_tokens: int) -> None:
        """Insert the full blocks of `seq`'s first `num_tokens` tokens and re-match (module docstring)."""
        k = min(num_tokens // self.block_size, len(seq.block_table))
        if not self.enabled or k == 0 or seq.seq_id not in self.locked:
            return
        tokens = seq.token_ids[: k * self.block_size]
        self.tree.insert(tokens, seq.block_table[:k])
        pages, node = self.tree.match_prefix(tokens)
        # older blocks hold finished K/V
        written_before = seq.num_computed_tokens // self.block_size
        for i in range(min(written_before, len(pages))):
            if seq.block_table[i] != pages[i]:
                self.pool.incref(pages[i])
                self.pool.decref(seq.block_table[i])  # the duplicate goes back to the pool
                seq.block_table[i] = pages[i]
        self.tree.lock(node)
        self.tree.unlock(self.locked[seq.seq_id])
        self.locked[seq.seq_id] = node

    # ------------------------------------------------------------------ release
    def free(self, seq: SGLSequence) -> None:
        """Finish, abort or preemption: unlock the request's path (its blocks stay cached in the tree)
        and drop its references; duplicates of cached blocks return to the pool here."""
        self.matched.pop(seq.seq_id, None)
        node = self.locked.pop(seq.seq_id, None)
        if node is not None:
            self.tree.unlock(node)
        super().free(seq)

    def fork(self, parent: SGLSequence, child: SGLSequence) -> None:
        super().fork(parent, child)
        node = self.locked.get(parent.seq_id)
        if node is not None:
            self.tree.lock(node)
            self.locked[child.seq_id] = node

    def reset_prefix_cache(self) -> None:
        """Forget the tree (a step failed: blocks it inserted hold no K/V). Locks die with it."""
        self.tree.clear()
        self.locked.clear()
        self.matched.clear()
