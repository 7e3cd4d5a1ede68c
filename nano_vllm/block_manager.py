"""The KV cache manager of vLLM (arXiv 2309.06180) §4.2, with automatic prefix caching (§4.4, "shared prefix").

The KV cache is cut into fixed-size *blocks* of `block_size` tokens. A sequence's logical blocks map to
physical blocks through its block table (`Sequence.block_table`), so a sequence grows one block at a time
wherever a free block is, and never reserves memory for tokens it may not generate (§4.2, Fig. 6).

Three small pieces, each with one job (mini-sglang style), so nano_sglang can swap the prefix cache for a
radix tree without touching the rest:

* `BlockPool`      physical blocks: reference counts and the LRU list of free blocks.
* `PrefixCache`    automatic prefix caching: a *full* block is known by the hash of its tokens chained with
                   its parent block's hash, so one lookup per block finds the longest cached prefix of a
                   prompt; on a hit the stored parent hash and tokens are compared, so a hash collision can
                   never hand a sequence someone else's K/V.
* `BlockManager`   per-sequence block tables: admission with prefix-cache hits, growth by prefill chunks and
                   decode steps, copy-on-write after `fork` (§4.4, parallel sampling), release.

Invariants (checked after every operation by tests/nano_vllm/test_block_manager.py):
* `ref_count[b]` equals the number of block-table entries naming b; a block is free iff its count is 0.
* Only full blocks are hashed, and a block is hashed (`cache_blocks`) once its tokens' K/V are computed or
  surely scheduled in the current step, so a second identical prompt in the same step may share it: each
  layer writes all of a step's K/V before any attention of that layer reads the cache.
* Shared blocks are never written: a hit is a full block before the tokens a step computes, and a write
  into a block shared by `fork` first copies it (the copy is queued in `pending_copies` for the runner).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Protocol

from nano_vllm.sequence import Sequence


class BlockPool:
    """Reference-counted physical blocks. Free blocks wait in least-recently-freed order; a free block
    keeps its K/V (and its prefix-cache entry) until `allocate` hands it out again, which is what makes a
    finished request's prompt reusable by the next one."""

    def __init__(self, num_blocks: int, on_reuse: Callable[[int], None] | None = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks, self.ref_counts = num_blocks, [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # called with a block id when its old contents are about to be overwritten
        self.on_reuse = on_reuse

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        if self.on_reuse is not None:
            self.on_reuse(block_id)  # its stale hash must go before anyone can hit it again
        self.ref_counts[block_id] = 1
        return block_id

    def incref(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.free[block_id]  # a cached free block comes back to life
        self.ref_counts[block_id] += 1

    def decref(self, block_id: int) -> None:
        if self.ref_counts[block_id] <= 0:
            raise RuntimeError(f"block {block_id} freed more often than allocated")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free[block_id] = None  # most recently freed: reused last


class PrefixCacheProtocol(Protocol):
    """What BlockManager needs from a prefix cache (nano_sglang plugs a radix tree in here).

    match(token_ids)                   -> blocks holding the longest cached full-block prefix (no side effects)
    insert(token_ids, block_table, n)  -> remember that the first n blocks of the table hold those tokens
    evict(block_id)                    -> the block is being reused: forget it
    clear()                            -> forget everything
    """

    def match(self, token_ids: Seq[int]) -> list[int]: ...
    def insert(self, token_ids: Seq[int], block_table: Seq[int], num_full_blocks: int) -> None: ...
    def evict(self, block_id: int) -> None: ...
    def clear(self) -> None: ...


class PrefixCache:
    """Hash chain over full blocks: hash(block i) = hash((hash(block i-1), tokens of block i))."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.hash_to_block: dict[int, int] = {}
        # block -> (its hash, (parent hash, its tokens)); kept for every hashed block, mapped or not.
        self.block_info: dict[int, tuple[int, tuple[int | None, tuple[int, ...]]]] = {}

    @staticmethod
    def block_hash(parent_hash: int | None, tokens: tuple[int, ...]) -> int:
        # Python's tuple-of-int hash is deterministic across processes (no hash randomisation for ints).
        return hash((parent_hash, tokens))

    def match(self, token_ids: Seq[int]) -> list[int]:
        """Physical blocks holding the longest cached full-block prefix of `token_ids`."""
        bs, parent, blocks = self.block_size, None, []
        for i in range(len(token_ids) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = self.block_hash(parent, tokens)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.block_info[block_id][1] != (parent, tokens):
                break  # a miss (or a hash collision, caught by comparing what was hashed)
            blocks.append(block_id)
            parent = h
        return blocks

    def hash_of(self, block_id: int) -> int | None:
        info = self.block_info.get(block_id)
        return None if info is None else info[0]

    def insert(self, token_ids: Seq[int], block_table: Seq[int], num_full_blocks: int) -> None:
        bs, first = self.block_size, num_full_blocks
        while first > 0 and self.hash_of(block_table[first - 1]) is None:
            # a sequence's hashed blocks form a prefix of its table: walk back to its end
            first -= 1
        parent = self.hash_of(block_table[first - 1]) if first > 0 else None
        for i in range(first, num_full_blocks):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = self.block_hash(parent, tokens)
            self.block_info[block_table[i]] = (h, (parent, tokens))
            # an identical cached block stays the one found
            self.hash_to_block.setdefault(h, block_table[i])
            parent = h

    def evict(self, block_id: int) -> None:
        """Forget a block whose contents are about to be overwritten (it was reallocated)."""
        info = self.block_info.pop(block_id, None)
        if info is not None and self.hash_to_block.get(info[0]) == block_id:
            del self.hash_to_block[info[0]]

    def clear(self) -> None:
        self.hash_to_block.clear()
        self.block_info.clear()


class BlockManager:
    """Block tables of all sequences over one BlockPool, with an optional prefix cache (§4.2): the hash
    chain by default, or any `PrefixCacheProtocol` passed as `prefix_cache`."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 prefix_cache: PrefixCacheProtocol | None = None):
        self.block_size = block_size
        self.cache = prefix_cache or (PrefixCache(block_size) if enable_prefix_caching else None)
        self.pool = BlockPool(num_blocks, on_reuse=self.cache.evict if self.cache else None)
        # (src, dst) copy-on-write, done before the next step
        self.pending_copies: list[tuple[int, int]] = []

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks for the start of `seq` (which holds no blocks yet); no side effects."""
        return self.cache.match(seq.token_ids) if self.cache is not None else []

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached_blocks: Seq[int] = (),
                       num_computed_tokens: int | None = None) -> bool:
        """Make room for the K/V of tokens [computed, computed + num_new_tokens) of `seq`.

        On admission (the sequence holds no blocks) pass `num_computed_tokens`, where this step starts, and
        the prefix-cache hit `cached_blocks` (from `match_prefix`; the step may start inside it, see the
        scheduler), which become the start of the block table. Afterwards the sequence's own
        `num_computed_tokens` is the start. Returns False, changing nothing, when blocks run out.
        """
        admission = num_computed_tokens is not None
        if admission and seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} is being admitted but already holds blocks")
        start = num_computed_tokens if admission else seq.num_computed_tokens
        end = start + num_new_tokens
        num_cached_tokens = (len(cached_blocks) * self.block_size if admission
                             else seq.num_cached_tokens)
        if end > seq.num_tokens or (admission and start > num_cached_tokens):
            raise ValueError(f"sequence {seq.seq_id}: slots [{start}, {end}) with {seq.num_tokens} "
                             f"tokens, {num_cached_tokens} cached")
        # Nothing changes before the check below passes, so a running sequence's table is edited in place.
        table = list(cached_blocks) if admission else seq.block_table
        # K/V of earlier tokens are already in the cache
        first_write = max(start, num_cached_tokens)
        cow = first_write < end and first_write // self.block_size < len(table) and \
            self.pool.ref_counts[table[first_write // self.block_size]] > 1
        new_blocks = self.blocks_for(end) - len(table)
        if not admission and not cow and new_blocks <= 0:
            return True  # the common decode step: the token fits in the last block
        # cached blocks no sequence holds leave the free list
        reviving = sum(1 for b in cached_blocks if self.pool.ref_counts[b] == 0)
        if max(new_blocks, 0) + int(cow) + reviving > self.pool.num_free:
            return False
        for b in cached_blocks:
            self.pool.incref(b)
        if cow:  # §4.4 copy-on-write: the next token goes into a block another sequence also reads
            i = first_write // self.block_size
            new = self.pool.allocate()
            self.pending_copies.append((table[i], new))
            self.pool.decref(table[i])
            table[i] = new
        table.extend(self.pool.allocate() for _ in range(new_blocks))
        seq.block_table = table
        if admission:
            seq.num_cached_tokens = num_cached_tokens
            seq.num_computed_tokens = start
        return True

    def cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the blocks of `seq` that are full once its first `num_tokens` tokens are computed.

        Called by the scheduler once it is sure the step computes those tokens (a sequence preempted
        later in the same scheduling pass must not leave hashes of blocks nobody computed)."""
        if self.cache is not None:
            self.cache.insert(seq.token_ids, seq.block_table, num_tokens // self.block_size)

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq` (finish, abort or preemption). Tail blocks are released first, so
        they are reused before the head blocks, which are the likelier shared prefixes."""
        for block_id in reversed(seq.block_table):
            self.pool.decref(block_id)
        if self.pending_copies:  # the copy-on-write target of this sequence is gone with it
            mine = set(seq.block_table)
            self.pending_copies = [(s, d) for s, d in self.pending_copies
                                   if d not in mine or self.pool.ref_counts[d] > 0]
        seq.block_table = []
        seq.num_computed_tokens = 0  # (num_cached_tokens stays, for metrics; admission resets both)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let `child` share all of `parent`'s blocks (§4.4, parallel sampling); the first write into a
        shared partial block copies it (copy-on-write, in `allocate_slots`)."""
        if child.block_table:
            raise ValueError(f"fork: child sequence {child.seq_id} already holds blocks")
        for block_id in parent.block_table:
            self.pool.incref(block_id)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks stay where they are; only future hits are lost)."""
        if self.cache is not None:
            self.cache.clear()

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies
