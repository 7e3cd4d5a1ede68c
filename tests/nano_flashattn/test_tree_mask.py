"""Tree attention (SpecInfer §4.2; EAGLE-2's tree mask): `flash_attn_varlen_func(..., tree_mask=)`.

A speculative decoder verifies a draft tree in one target forward: each sequence's new rows are the tree's
nodes (the last keys of the sequence), and a node sees the cached prefix, its ancestors and itself. The
Triton kernel (interpreter on a CPU) is checked against the torch reference with FlashAttention's error
rule, the reference against fp64 SDPA with an explicit mask built from the trees' parent lists, and a
chain against causal attention bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import nano_flashattn as fa

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _cu(lens, device):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _parents(shape: str, n: int, gen: torch.Generator | None = None) -> list[int]:
    """A draft tree of n nodes in topological order as parent indices (-1: the root)."""
    if shape == "chain":
        return [i - 1 for i in range(n)]
    if shape == "star":  # Medusa's first level: every candidate a child of the root
        return [-1] + [0] * (n - 1)
    if shape == "deep":  # a long trunk with side branches
        trunk = n // 2 + 1
        rest = [int(torch.randint(0, trunk, (1,), generator=gen)) for _ in range(n - trunk)]
        return [i - 1 for i in range(trunk)] + rest
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]  # random


def _ancestors(parents: list[int]) -> torch.Tensor:
    """(n, n) bool: row i sees node j iff j is i or one of its ancestors."""
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def _tree_mask(trees: list[list[int]], device) -> torch.Tensor:
    """The packed mask: (total new tokens, max tree size), row block b = tree b's ancestor matrix."""
    width = max(len(p) for p in trees)
    mask = torch.zeros(sum(len(p) for p in trees), width, dtype=torch.bool)
    row = 0
    for p in trees:
        mask[row : row + len(p), : len(p)] = _ancestors(p)
        row += len(p)
    return mask.to(device)


def _batch(trees, prefixes, hq, hk, d, dtype, page, device, seed=0):
    """q rows for the trees' nodes; K/V of prefix + nodes per sequence, packed or in a shuffled paged cache."""
    gen = torch.Generator().manual_seed(seed)
    lens_q = [len(p) for p in trees]
    lens_k = [a + b for a, b in zip(prefixes, lens_q)]
    q = torch.randn(sum(lens_q), hq, d, generator=gen).to(device=device, dtype=dtype)
    table = None
    if page is None:
        k, v = (torch.randn(sum(lens_k), hk, d, generator=gen).to(device=device, dtype=dtype)
                for _ in range(2))
    else:
        max_pages = max(-(-n // page) for n in lens_k)
        num_pages = len(lens_k) * max_pages + 2
        table = torch.randperm(num_pages, generator=gen)[: len(lens_k) * max_pages].view(len(lens_k), -1)
        table = table.to(device=device, dtype=torch.int32)
        k, v = (torch.randn(num_pages, page, hk, d, generator=gen).to(device=device, dtype=dtype)
                for _ in range(2))
    args = (_cu(lens_q, device), _cu(lens_k, device), max(lens_q), max(lens_k))
    return q, k, v, args, dict(block_table=table, return_lse=True)


def _sdpa(q, k, v, trees, prefixes, page, block_table):
    """fp64 SDPA per sequence with an explicit mask: the prefix, then the ancestor matrix."""
    outs, qr, kr = [], 0, 0
    for b, (p, pre) in enumerate(zip(trees, prefixes)):
        m, n = len(p), pre + len(p)
        if page is None:
            kb, vb = k[kr : kr + n], v[kr : kr + n]
        else:
            pages = block_table[b, : -(-n // page)].long()
            kb, vb = (c[pages].reshape(-1, *c.shape[2:])[:n] for c in (k, v))
        mask = torch.cat([torch.ones(m, pre, dtype=torch.bool), _ancestors(p)], 1).to(q.device)
        group = q.shape[1] // k.shape[-2]
        qb, kb, vb = (t.double().transpose(0, 1) for t in (q[qr : qr + m], kb, vb))
        kb, vb = kb.repeat_interleave(group, 0), vb.repeat_interleave(group, 0)
        outs.append(F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask).transpose(0, 1))
        qr, kr = qr + m, kr + n
    return torch.cat(outs)


def _compare(fa_check, trees, prefixes, d, dtype, page, hq=4, hk=2, device=DEVICE):
    q, k, v, args, kw = _batch(trees, prefixes, hq, hk, d, dtype, page, device)
    tree_mask = _tree_mask(trees, device)
    out, lse = fa.flash_attn_varlen_func_triton(q, k, v, *args, tree_mask=tree_mask, **kw)
    ro, rl = fa.flash_attn_varlen_func_torch(q.double(), k.double(), v.double(), *args,
                                             tree_mask=tree_mask, **kw)
    lo, ll = fa.flash_attn_varlen_func_torch(q, k, v, *args, tree_mask=tree_mask, **kw)
    fa_check("out", out, lo, ro)
    fa_check("lse", lse, ll, rl)
    torch.testing.assert_close(ro, _sdpa(q, k, v, trees, prefixes, page, kw["block_table"]),
                               rtol=0, atol=1e-10)


def _trees(shapes_sizes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [_parents(shape, n, gen) for shape, n in shapes_sizes]


# a chain, a star, a deep tree, a random tree and a one-node tree of different sizes in one batch, and a
# sequence with no draft this step; one sequence without a cached prefix (its tree is all of its keys),
# prefixes not multiples of the tiles
MIXED = [("chain", 7), ("star", 9), ("deep", 21), ("chain", 0), ("random", 18), ("random", 1)]
PREFIXES = [37, 0, 22, 8, 5, 13]


@pytest.mark.parametrize("d,dtype,page", [(64, torch.float32, None), (128, torch.float32, 16),
                                          (64, torch.float16, 16), (128, torch.float16, None)])
def test_trees_against_reference_and_sdpa(fa_check, d, dtype, page):
    _compare(fa_check, _trees(MIXED), PREFIXES, d, dtype, page)


@pytest.mark.parametrize("page", [None, 16])
def test_chain_is_causal_bit_for_bit(page):
    # 20 new rows after 20 cached keys: with causal, key tile [16, 32) is fully visible to row tile
    # [16, 20); with the tree it is masked, and a chain's bits must give the same sums anyway
    trees, prefixes = [_parents("chain", 20), _parents("chain", 3)], [20, 30]
    q, k, v, args, kw = _batch(trees, prefixes, 2, 1, 64, torch.float32, page, DEVICE)
    tree = fa.flash_attn_varlen_func_triton(q, k, v, *args, tree_mask=_tree_mask(trees, DEVICE), **kw)
    causal = fa.flash_attn_varlen_func_triton(q, k, v, *args, causal=True, **kw)
    assert torch.equal(tree[0], causal[0]) and torch.equal(tree[1], causal[1])
    ref = fa.flash_attn_varlen_func_torch(q, k, v, *args, tree_mask=_tree_mask(trees, DEVICE), **kw)
    ref_causal = fa.flash_attn_varlen_func_torch(q, k, v, *args, causal=True, **kw)
    assert torch.equal(ref[0], ref_causal[0]) and torch.equal(ref[1], ref_causal[1])


def test_plain_name_dispatches_the_tree_mask():
    trees = _trees([("random", 6), ("star", 4)])
    q, k, v, args, _ = _batch(trees, [5, 9], 2, 2, 16, torch.float32, None, "cpu")
    mask = _tree_mask(trees, "cpu")
    out = fa.flash_attn_varlen_func(q, k, v, *args, tree_mask=mask)  # CPU tensors: the reference
    torch.testing.assert_close(out, _sdpa(q, k, v, trees, [5, 9], None, None).float())


def _bad(mask_fn, match, **kw):
    trees = _trees([("random", 5), ("chain", 3)])
    q, k, v, args, base = _batch(trees, [4, 0], 2, 1, 16, torch.float32, None, "cpu")
    mask = mask_fn(_tree_mask(trees, "cpu"))
    for impl in (fa.flash_attn_varlen_func_torch, fa.flash_attn_varlen_func_triton):
        with pytest.raises(ValueError, match=match):
            impl(q, k, v, *args, tree_mask=mask, **{**base, **kw})


def _omit_self(m):
    m = m.clone()
    m[6, 1] = False  # row 6: new token 1 of the second sequence
    return m


def _later_node(m):
    m = m.clone()
    m[1, 3] = True  # node 1 sees node 3
    return m


@pytest.mark.parametrize("mask_fn,match,kw", [
    (lambda m: m[:-1], r"tree_mask must have shape \(q.shape\[0\]=8, max_seqlen_q=5\)", {}),
    (lambda m: m[:, :4], r"tree_mask must have shape .*cu_seqlens_q", {}),
    (lambda m: m.to(torch.uint8), "tree_mask must be torch.bool", {}),
    (lambda m: m.tolist(), "tree_mask must be a torch.Tensor", {}),
    (_omit_self, r"tree_mask row 6 \(new token 1 of its sequence\) omits itself", {}),
    (_later_node, r"tree_mask row 1 .* sees a later node", {}),
    (lambda m: m, r"window_size .* with tree_mask", {"window_size": (4, 0)}),
])
def test_bad_tree_masks_are_named(mask_fn, match, kw):
    _bad(mask_fn, match, **kw)


def test_tree_needs_its_nodes_among_the_keys_and_no_grad():
    trees = _trees([("random", 5)])
    q, k, v, (cu_q, cu_k, mq, _), _ = _batch(trees, [0], 2, 1, 16, torch.float32, None, "cpu")
    mask = _tree_mask(trees, "cpu")
    short = torch.tensor([0, 3], dtype=torch.int32)
    for impl in (fa.flash_attn_varlen_func_torch, fa.flash_attn_varlen_func_triton):
        with pytest.raises(ValueError, match="tree_mask: sequence 0 has fewer keys"):
            impl(q, k, v, cu_q, short, mq, 3, tree_mask=mask)
    with pytest.raises(ValueError, match="tree_mask: no backward"):
        fa.flash_attn_varlen_func_triton(q.requires_grad_(), k, v, cu_q, cu_k, mq, 5, tree_mask=mask)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("page", [None, 16])
def test_gpu_bf16_trees(fa_check, d, page):
    """bf16 on the GPU's tiles: EAGLE-2-sized trees (60 nodes) and Medusa-like ones behind long prefixes,
    plus a chain against causal attention."""
    trees = _trees([("random", 60), ("star", 26), ("deep", 64), ("chain", 5), ("random", 1)], seed=1)
    prefixes = [1000, 3, 517, 2048, 64]
    _compare(fa_check, trees, prefixes, d, torch.bfloat16, page, hq=32, hk=8, device="cuda")
    trees = [_parents("chain", 64), _parents("chain", 7)]
    q, k, v, args, kw = _batch(trees, [300, 129], 8, 2, d, torch.bfloat16, page, "cuda")
    tree = fa.flash_attn_varlen_func(q, k, v, *args, tree_mask=_tree_mask(trees, "cuda"), **kw)
    causal = fa.flash_attn_varlen_func(q, k, v, *args, causal=True, **kw)
    torch.testing.assert_close(tree[0], causal[0], rtol=0, atol=2e-2)
    torch.testing.assert_close(tree[1], causal[1], rtol=0, atol=1e-4)
