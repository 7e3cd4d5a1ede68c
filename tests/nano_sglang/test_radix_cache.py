"""RadixCache against a brute-force model: a dict from every cached page-aligned prefix to its page.

Randomised operations — admit (match, lock, evict for room, allocate), chunk (insert + re-match), finish
(insert, free duplicates), abort, match-only (an abort between match and allocation), evict — for page
sizes 1, 4 and 16; after every one: free + evictable + protected + request-private = pool size, each
page owned exactly once (reference counts = owners), no locked node evicted, lock counts = requests below,
each match = the longest cached page-aligned prefix.
"""

from __future__ import annotations

import random

import pytest

from nano_sglang.radix_cache import RadixCache, TreeNode
from nano_vllm.block_manager import BlockPool

POOL = 48


class Req:
    def __init__(self, tokens, table, node, computed):
        self.tokens, self.table, self.node, self.computed = tokens, table, node, computed


def tree_nodes(tree: RadixCache) -> list[TreeNode]:
    """Every node, the root first."""
    out, stack = [], [tree.root]
    while stack:
        out.append(stack.pop())
        stack += out[-1].children.values()
    return out


def tree_prefixes(tree: RadixCache) -> dict[tuple, int]:
    out, stack = {}, [(tree.root, ())]
    ps = tree.page_size
    while stack:
        node, prefix = stack.pop()
        for i, p in enumerate(node.pages):
            out[prefix + node.key[: (i + 1) * ps]] = p
        for child in node.children.values():
            stack.append((child, prefix + node.key))
    return out


def brute_match(ref: dict, tokens, ps: int) -> list[int]:
    pages = []
    for k in range(1, len(tokens) // ps + 1):
        page = ref.get(tuple(tokens[: k * ps]))
        if page is None:
            break
        pages.append(page)
    return pages


def check(tree: RadixCache, pool: BlockPool, reqs: dict, ref: dict) -> None:
    prefixes = tree_prefixes(tree)
    assert prefixes == ref, "tree contents differ from the reference"
    tree_pages = list(prefixes.values())
    assert len(set(tree_pages)) == len(tree_pages), "a page cached twice"
    owners = [0] * pool.num_blocks
    for p in tree_pages:
        owners[p] += 1
    private = set()
    for r in reqs.values():
        for p in r.table:
            owners[p] += 1
        private |= set(r.table) - set(tree_pages)
    assert owners == pool.ref_counts, "reference counts differ from owners"
    assert all(pool.ref_counts[p] == 0 for p in pool.free)
    assert pool.num_free + tree.evictable_size + tree.protected_size + len(private) == pool.num_blocks
    # lock counts: the number of requests whose locked node lies in the subtree
    locks: dict[int, int] = {}
    for r in reqs.values():
        node = r.node
        while node is not tree.root:
            locks[node.id] = locks.get(node.id, 0) + 1
            node = node.parent
    nodes = tree_nodes(tree)[1:]
    assert all(n.lock_ref == locks.get(n.id, 0) for n in nodes)
    assert tree.evictable_size == sum(len(n.pages) for n in nodes if n.lock_ref == 0)
    assert tree.protected_size == sum(len(n.pages) for n in nodes if n.lock_ref > 0)
    for r in reqs.values():  # every request's locked path is still in the tree
        assert r.node is tree.root or r.node.parent is not None


def run_ops(ps: int, num_ops: int, seed: int) -> None:
    rng = random.Random(seed)
    pool = BlockPool(POOL)
    tree = RadixCache(pool, ps)
    reqs: dict[int, Req] = {}
    ref: dict[tuple, int] = {}
    alphabet = [1, 2] if ps == 1 else [1, 2, 3]
    stems = [[rng.choice(alphabet) for _ in range(6 * ps)] for _ in range(4)]
    next_id = 0

    def add_to_ref(tokens, pages):
        for k in range(1, len(pages) + 1):
            ref.setdefault(tuple(tokens[: k * ps]), pages[k - 1])

    def release(r: Req) -> None:
        tree.unlock(r.node)
        for p in r.table:
            pool.decref(p)

    for _ in range(num_ops):
        op = rng.random()
        if op < 0.3 or not reqs:  # admit a request
            stem = rng.choice(stems)
            tokens = stem[: rng.randint(0, len(stem))] + [rng.choice(alphabet) for _ in range(rng.randint(1, 3 * ps))]
            pages, node = tree.match_prefix(tokens)
            assert pages == brute_match(ref, tokens, ps)
            assert tree.path_len(node) == len(pages) * ps
            tree.lock(node)
            need = -(-len(tokens) // ps) - len(pages)
            if pool.num_free < need:
                evictable = tree.evictable_size
                released = tree.evict(need - pool.num_free)
                assert released >= min(need - (pool.num_free - released), evictable) or released == evictable
                for key in [k for k in ref if k not in tree_prefixes(tree)]:
                    del ref[key]
            if pool.num_free < need:  # the pool cannot hold it: give everything back
                tree.unlock(node)
            else:
                for p in pages:
                    pool.incref(p)
                table = pages + [pool.allocate() for _ in range(need)]
                reqs[next_id] = Req(tokens, table, node, len(pages) * ps)
                next_id += 1
        elif op < 0.45:  # a chunk finishes: insert it, re-match so the table points at the tree's pages
            r = reqs[rng.choice(list(reqs))]
            c = rng.randint(r.computed, len(r.tokens))
            c -= c % ps
            tree.insert(r.tokens[:c], r.table[: c // ps])
            add_to_ref(r.tokens[:c], r.table[: c // ps])
            pages, node = tree.match_prefix(r.tokens[:c])
            assert pages == brute_match(ref, r.tokens[:c], ps) and len(pages) == c // ps
            for i, p in enumerate(pages):
                if r.table[i] != p:
                    pool.incref(p)
                    pool.decref(r.table[i])  # the duplicate goes back to the pool
                    r.table[i] = p
            tree.lock(node)
            tree.unlock(r.node)
            r.node, r.computed = node, c
        elif op < 0.65:  # finish: insert everything, free duplicates
            r = reqs.pop(rng.choice(list(reqs)))
            tree.insert(r.tokens, r.table)
            add_to_ref(r.tokens, r.table[: len(r.tokens) // ps])
            release(r)
        elif op < 0.75:  # abort
            release(reqs.pop(rng.choice(list(reqs))))
        elif op < 0.85:  # match only: the request is aborted before allocation
            stem = rng.choice(stems)
            tokens = stem[: rng.randint(0, len(stem))]
            assert tree.match_prefix(tokens)[0] == brute_match(ref, tokens, ps)
        else:  # evict under pressure
            locked = {id(n) for r in reqs.values() for n in _path(tree, r.node)}
            before = tree.evictable_size
            k = rng.randint(1, 8)
            released = tree.evict(k)
            assert released >= min(k, before)
            after = tree_prefixes(tree)
            for key in [k for k in ref if k not in after]:
                del ref[key]
            assert all(n.parent is not None for r in reqs.values() for n in _path(tree, r.node)), locked
        check(tree, pool, reqs, ref)
    for r in list(reqs.values()):
        release(r)
    tree.evict(POOL)
    assert pool.num_free == POOL and tree.total_pages() == 0


def _path(tree, node):
    out = []
    while node is not tree.root:
        out.append(node)
        node = node.parent
    return out


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_random_ops_against_brute_force(page_size):
    run_ops(page_size, 7000, seed=page_size)


def test_lru_evicts_least_recent_leaf_first():
    pool = BlockPool(8)
    tree = RadixCache(pool, 1)
    for tokens in ([1, 2, 3], [1, 2, 4], [5, 6]):
        pages = [pool.allocate() for _ in tokens]
        tree.insert(tokens, pages)
        for p in pages:
            pool.decref(p)
    tree.match_prefix([1, 2, 3])  # [1,2,4] and [5,6] are now older
    assert tree.evict(1) == 1 and tree.match_prefix([1, 2, 4])[0] == tree.match_prefix([1, 2])[0]
    assert tree.evict(1) == 2 and tree.match_prefix([5, 6])[0] == []
    assert tree.evict(3) == 3 and pool.num_free == 8


def test_locked_path_survives_eviction_and_split_keeps_lock():
    pool = BlockPool(6)
    tree = RadixCache(pool, 1)
    pages = [pool.allocate() for _ in range(4)]
    tree.insert([1, 2, 3, 4], pages)
    _, node = tree.match_prefix([1, 2, 3, 4])
    tree.lock(node)
    tree.match_prefix([1, 2, 9])  # splits the locked edge after [1, 2]
    assert tree.evict(10) == 0 and tree.protected_size == 4
    tree.unlock(node)
    assert tree.evictable_size == 4
    with pytest.raises(RuntimeError, match="unlock of an unlocked node"):
        tree.unlock(node)


def test_bad_page_size():
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        RadixCache(BlockPool(4), 0)
