"""Theorem 3.1 (SGLang, arXiv 2312.07104, §3): with a cache at least as large as the longest request, serving
a batch in longest-prefix-match order (DFS order of the requests' radix tree) computes every edge of that
tree exactly once — Σ|edges| prefill tokens, the minimum — while arrival (FCFS) order computes more."""

from __future__ import annotations

import random

from nano_sglang.radix_cache import RadixCache
from nano_sglang.scheduler import dfs_weight_order, lpm_order
from nano_vllm.block_manager import BlockPool
from nano_vllm.sequence import Sequence


def random_batch(rng: random.Random) -> list[list[int]]:
    """Requests as random paths through a random tree of token runs; a unique last token keeps any request
    from being a prefix of another."""
    reqs = []
    for i in range(rng.randint(6, 14)):
        path, node = [], ()
        for depth in range(rng.randint(1, 4)):
            branch = rng.randrange(3)
            rng2 = random.Random(hash((node, depth, branch)))
            run = [rng2.randrange(50) for _ in range(rng2.randint(1, 6))]
            path += run
            node = (*node, branch)
        reqs.append([*path, 1000 + i])
    return reqs


def edges(reqs: list[list[int]]) -> int:
    """Σ|edges| of the requests' radix tree = the number of distinct non-empty prefixes."""
    return len({tuple(r[:k]) for r in reqs for k in range(1, len(r) + 1)})


def serve(reqs: list[list[int]], policy: str) -> int:
    """One request at a time over a pool of exactly max-length slots; returns prefill tokens computed."""
    pool = BlockPool(max(len(r) for r in reqs))
    tree = RadixCache(pool, 1)
    waiting = [Sequence(r) for r in reqs]
    computed = 0
    while waiting:
        if policy == "fcfs":
            seq = waiting[0]
        else:
            matched = {s.seq_id: tree.match_prefix(s.token_ids) for s in waiting}
            if policy == "lpm":
                seq = lpm_order(waiting, {k: len(v[0]) for k, v in matched.items()})[0]
            else:
                seq = dfs_weight_order(waiting, {k: v[1] for k, v in matched.items()}, tree.root)[0]
        waiting.remove(seq)
        pages, node = tree.match_prefix(seq.token_ids)
        tree.lock(node)
        need = len(seq.token_ids) - len(pages)
        if pool.num_free < need:
            tree.evict(need - pool.num_free)
        assert pool.num_free >= need  # the pool holds the longest request
        for p in pages:
            pool.incref(p)
        table = pages + [pool.allocate() for _ in range(need)]
        computed += need
        tree.insert(seq.token_ids, table)
        tree.unlock(node)
        for p in table:
            pool.decref(p)
    return computed


def test_theorem_3_1_longest_prefix_first_is_optimal():
    worse = 0
    for seed in range(40):
        rng = random.Random(seed)
        reqs = random_batch(rng)
        rng.shuffle(reqs)
        optimum = edges(reqs)
        assert serve(reqs, "lpm") == optimum, seed
        fcfs = serve(reqs, "fcfs")
        assert fcfs >= optimum
        worse += fcfs > optimum
    assert worse >= 30, f"FCFS was worse than optimal on only {worse}/40 seeds"


def test_dfs_weight_runs_the_heaviest_subtree_first_and_keeps_subtrees_together():
    """dfs-weight is SGLang's heuristic, not Theorem 3.1's order: re-evaluated after every request with a
    cache of only the longest request it may jump between subtrees, so it is checked on one batch here."""
    pool = BlockPool(32)
    tree = RadixCache(pool, 1)
    for r in ([1, 2, 3], [7, 8, 9]):
        table = [pool.allocate() for _ in r]
        tree.insert(r, table)
    reqs = [Sequence(r) for r in ([7, 8, 9, 1], [1, 2, 3, 4], [1, 2, 3, 5], [7, 8, 9, 2], [1, 2, 3, 6], [5])]
    nodes = {s.seq_id: tree.match_prefix(s.token_ids)[1] for s in reqs}
    order = [s.token_ids for s in dfs_weight_order(reqs, nodes, tree.root)]
    assert order == [[5], [1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 6], [7, 8, 9, 1], [7, 8, 9, 2]]
