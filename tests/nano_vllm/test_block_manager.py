"""The KV cache manager (§4.2) against a brute-force model, and each prefix-cache edge case."""

from __future__ import annotations

import random

import pytest
from kv_model import KVModel

from nano_vllm.block_manager import BlockManager, PrefixCache
from nano_vllm.sequence import Sequence


def _step(bm: BlockManager, kv: KVModel, seq: Sequence, n: int, admit: bool = False) -> bool:
    """One engine step of `seq` for n tokens: allocate, hash, copy, write, read, advance."""
    if admit:
        cached = bm.match_prefix(seq)
        start = min(len(cached) * bm.block_size, seq.num_tokens - 1)
        n = min(n, seq.num_tokens - start)
        ok = bm.allocate_slots(seq, n, cached, num_computed_tokens=start)
    else:
        start = seq.num_computed_tokens
        ok = bm.allocate_slots(seq, n)
    if not ok:
        return False
    bm.cache_blocks(seq, start + n)
    kv.copy(bm.take_copies())
    kv.write(seq, start, start + n)
    kv.check_reads(seq, start + n)
    seq.num_computed_tokens = start + n
    return True


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_random_operations_against_brute_force(prefix_caching):
    rng = random.Random(0 if prefix_caching else 1)
    bm = BlockManager(num_blocks=24, block_size=4, enable_prefix_caching=prefix_caching)
    kv = KVModel(bm)
    bases = [[rng.randrange(3) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    live: list[Sequence] = []
    counts = {"admit": 0, "chunk": 0, "decode": 0, "fork": 0, "free": 0, "full": 0, "hit": 0}
    for _ in range(3000):
        op = rng.random()
        if op < 0.3 or not live:  # admit a new request: a shared base plus a random tail
            prompt = rng.choice(bases) + [rng.randrange(3) for _ in range(rng.randrange(0, 6))]
            seq = Sequence(prompt or [0])
            if _step(bm, kv, seq, rng.randrange(1, 12), admit=True):
                live.append(seq)
                counts["admit"] += 1
                counts["hit"] += seq.num_cached_tokens > 0
            else:
                counts["full"] += 1
        elif op < 0.75:  # the next chunk of a prompt, or a decode step with a new token
            seq = rng.choice(live)
            if seq.num_uncomputed_tokens == 0:
                seq.append_token(rng.randrange(3))
                n, kind = 1, "decode"
            else:
                n, kind = rng.randrange(1, seq.num_uncomputed_tokens + 1), "chunk"
            if _step(bm, kv, seq, n):
                counts[kind] += 1
            else:  # out of blocks: preempt it (recomputation, §4.5)
                bm.free(seq)
                live.remove(seq)
                counts["full"] += 1
        elif op < 0.85:  # parallel sampling: the child shares every block (§4.4)
            parent = rng.choice(live)
            child = Sequence(parent.token_ids)
            bm.fork(parent, child)
            live.append(child)
            counts["fork"] += 1
        else:
            seq = rng.choice(live)
            bm.free(seq)
            live.remove(seq)
            counts["free"] += 1
        kv.check_invariants(live)
    for seq in live:
        bm.free(seq)
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.pool.ref_counts)
    assert min(counts.values()) > 20 or (not prefix_caching and counts["hit"] == 0), counts
    assert prefix_caching == (counts["hit"] > 0)


def _admit(bm: BlockManager, tokens: list[int], n: int | None = None) -> Sequence:
    seq = Sequence(tokens)
    cached = bm.match_prefix(seq)
    start = min(len(cached) * bm.block_size, seq.num_tokens - 1)
    n = seq.num_tokens - start if n is None else n
    assert bm.allocate_slots(seq, n, cached, num_computed_tokens=start)
    bm.cache_blocks(seq, start + n)
    seq.num_computed_tokens = start + n
    return seq


def test_full_blocks_only_and_parent_chained():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = _admit(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # 2 full blocks + 2 tokens
    assert len(bm.cache.hash_to_block) == 2  # the partial third block is not cached
    # Same second block after a different first block: no hit (the parent hash differs).
    assert bm.match_prefix(Sequence([0, 2, 3, 4, 5, 6, 7, 8])) == []
    assert bm.match_prefix(Sequence([1, 2, 3, 4, 5, 6, 7, 0])) == a.block_table[:1]
    assert bm.match_prefix(Sequence([1, 2, 3, 4, 5, 6, 7, 8, 9])) == a.block_table[:2]


def test_hash_collision_is_caught_by_token_check(monkeypatch):
    monkeypatch.setattr(PrefixCache, "block_hash", staticmethod(lambda parent, tokens: 42))
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _admit(bm, [1, 2, 3, 4, 9])
    assert bm.match_prefix(Sequence([5, 6, 7, 8, 9])) == []  # same (fake) hash, other tokens: a miss
    assert bm.match_prefix(Sequence([1, 2, 3, 4, 0])) == a.block_table[:1]


def test_fully_cached_prompt_recomputes_only_its_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _admit(bm, [1, 2, 3, 4, 5, 6, 7, 8])
    bm.free(a)
    b = Sequence([1, 2, 3, 4, 5, 6, 7, 8])
    cached = bm.match_prefix(b)
    assert len(cached) == 2
    # The scheduler starts at len - 1: one token to run (its logits are the first output), no new block,
    # and no copy-on-write: that token's K/V is already in the cached block, so it is not rewritten.
    assert bm.allocate_slots(b, 1, cached, num_computed_tokens=7)
    assert b.block_table == cached and b.num_cached_tokens == 8 and bm.take_copies() == []
    assert bm.num_free_blocks == 6


def test_stale_hash_dropped_when_block_is_reused():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = _admit(bm, [1, 2, 3, 4, 5, 6, 7, 8])
    old = list(a.block_table)
    bm.free(a)
    assert bm.match_prefix(Sequence([1, 2, 3, 4, 5, 6, 7, 8])) == old  # free but still cached
    b = _admit(bm, [9, 9, 9, 9, 8, 8, 8, 8, 7, 7, 7, 7, 6])  # needs all 4 blocks: reuses a's two
    assert set(old) <= set(b.block_table)
    assert bm.match_prefix(Sequence([1, 2, 3, 4, 5, 6, 7, 8])) == []
    assert set(bm.cache.hash_to_block.values()) == set(b.block_table[:3])
    assert set(bm.cache.block_info) == set(b.block_table[:3])


def test_fork_copy_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    kv = KVModel(bm)
    parent = Sequence([1, 2, 3, 4, 5, 6])
    assert _step(bm, kv, parent, 6, admit=True)
    child = Sequence(parent.token_ids)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table and bm.pool.ref_counts[parent.block_table[1]] == 2
    child.append_token(7)
    assert _step(bm, kv, child, 1)  # writes into the shared partial block: copied first
    assert child.block_table[0] == parent.block_table[0] and child.block_table[1] != parent.block_table[1]
    parent.append_token(8)
    assert _step(bm, kv, parent, 1)  # now the parent's block is its own again: written in place
    kv.check_invariants([parent, child])


def test_allocation_failure_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = _admit(bm, [1, 2, 3, 4, 5, 6, 7, 8])
    seq = Sequence(list(range(20, 33)))
    before = (list(bm.pool.ref_counts), list(bm.pool.free), dict(bm.cache.hash_to_block))
    assert not bm.allocate_slots(seq, 13, [], num_computed_tokens=0)
    assert (list(bm.pool.ref_counts), list(bm.pool.free), dict(bm.cache.hash_to_block)) == before
    assert seq.block_table == [] and a.block_table


def test_a_prefix_cache_can_be_plugged_in():
    """nano_sglang's radix tree goes where PrefixCache is: BlockManager only calls the protocol."""

    class Recorder:
        def __init__(self):
            self.calls = []

        def match(self, token_ids):
            self.calls.append(("match", len(token_ids)))
            return []

        def insert(self, token_ids, block_table, num_full_blocks):
            self.calls.append(("insert", num_full_blocks))

        def evict(self, block_id):
            self.calls.append(("evict", block_id))

        def clear(self):
            self.calls.append(("clear",))

    rec = Recorder()
    bm = BlockManager(num_blocks=2, block_size=4, prefix_cache=rec)
    a = _admit(bm, [1, 2, 3, 4, 5])
    bm.free(a)
    _admit(bm, [6, 7, 8, 9])
    bm.reset_prefix_cache()
    assert rec.calls == [("match", 5), ("evict", 0), ("evict", 1), ("insert", 1), ("match", 4), ("evict", 1),
                         ("insert", 1), ("clear",)]
