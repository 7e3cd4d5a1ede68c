"""nano_specdec.sampling: the verification rules keep the target's distribution exactly.

Monte Carlo on a toy Markov "language model" over a small vocabulary: the target's distribution after a
token is a row of P, the draft's a row of Q. Many independent speculative steps run as one batch; the
distribution of the first emitted token, and of the first two (a second step runs where the first
emitted one token only), must equal the target's — a chi-square goodness-of-fit test at a fixed seed,
failing below p = 1e-4 — for adversarial drafts: the draft equal to the target, disjoint supports, a draft
whose mass sits where the target has none, random drafts, deterministic proposals, and for a tree,
independent drafts (SpecInfer), draws without replacement and top-k children. A wrong rule (rejections
resampled from p instead of the residual) fails the same test. Greedy verification returns exactly the
target's argmax path, for chains and trees.
"""

from __future__ import annotations

import pytest
import torch

from nano_specdec.sampling import (
    residual,
    verify_chain,
    verify_chain_greedy,
    verify_chains,
    verify_chains_greedy,
    verify_tree,
    verify_tree_greedy,
    verify_trees,
    verify_trees_greedy,
)

V = 6  # vocabulary
N = 100_000  # independent speculative steps per Monte Carlo test
K = 3  # drafts per chain
P_MIN = 1e-4  # a fit test fails below this p-value (at a fixed seed the outcome is fixed)
TREE = torch.tensor([-1, -1, 0])  # two children of the root, one grandchild under the first

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- the toy models
def random_rows(gen: torch.Generator, support: torch.Tensor | None = None, zeros: int = 0) -> torch.Tensor:
    """[V, V]: row c the distribution after token c; `support` [V] bool limits every row to those tokens,
    `zeros` more tokens per row get probability 0 (a top-k cut). Nonzero entries are ≥ ~0.05 so every
    cell of the fit test expects hundreds of counts."""
    w = torch.rand(V, V, generator=gen, dtype=torch.float64) + 0.3
    if support is not None:
        w = w * support
    for c in range(V):
        nonzero = w[c].nonzero().squeeze(1)
        drop = nonzero[torch.randperm(len(nonzero), generator=gen)[:zeros]]
        w[c, drop] = 0
    return w / w.sum(-1, keepdim=True)


def targets_and_drafts() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    even = torch.arange(V) % 2 == 0
    p = random_rows(gen, zeros=2)
    p_even = random_rows(gen, support=even)
    leaky = 0.8 * (p == 0) / (p == 0).sum(-1, keepdim=True) + 0.2 * random_rows(gen)
    return {
        "draft equals target": (p, p.clone()),
        "disjoint supports": (p_even, random_rows(gen, support=~even)),
        "draft mass where the target has none": (p, leaky),
        "random draft": (p, random_rows(gen)),
        "random draft, sparse": (random_rows(gen, zeros=3), random_rows(gen, zeros=3)),
    }


CASES = targets_and_drafts()


def pad_emitted(tokens: torch.Tensor, accepted: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
    """[B, n + 1]: each row's emitted tokens (accepted ones in node order, then nxt), then -1."""
    B, n = tokens.shape
    order = torch.sort((~accepted).long(), dim=1, stable=True).indices  # accepted nodes first
    m = accepted.sum(1)
    out = torch.where(torch.arange(n)[None] < m[:, None], tokens.gather(1, order), -1)
    out = torch.cat([out, torch.full((B, 1), -1)], 1)
    out[torch.arange(B), m] = nxt
    return out


def chain_step(P, Q, context, gen, deterministic=False):
    """One speculative step from each context token: K drafts from Q (or Q's argmax), verified."""
    drafts, q_rows, p_rows, last = [], [], [P[context]], context
    for _ in range(K):
        q = Q[last]
        x = q.argmax(-1) if deterministic else torch.multinomial(q, 1, generator=gen).squeeze(1)
        drafts.append(x)
        q_rows.append(q)
        p_rows.append(P[x])
        last = x
    tokens = torch.stack(drafts, 1)
    n, nxt = verify_chains(tokens, None if deterministic else torch.stack(q_rows, 1),
                           torch.stack(p_rows, 1), gen)
    assert ((n >= 0) & (n <= K)).all()
    return pad_emitted(tokens, torch.arange(K)[None] < n[:, None], nxt)


def tree_step(P, Q, context, gen, mode):
    """One step over TREE: nodes 0 and 1 children of the root, node 2 a child of node 0.

    "independent": node 0 from Q, node 1 from a second draft (P's and Q's mixture), node 2 from Q;
    "without replacement": node 1 from Q with node 0's token removed; "top-k": Q's top two, no probs."""
    B = len(context)
    q0 = Q[context]
    if mode == "top-k":
        x0, x1 = q0.topk(2, dim=-1).indices.unbind(1)
        q1 = None
    elif mode == "independent":
        q1 = 0.5 * (P[context] + q0)
        x0, x1 = (torch.multinomial(q, 1, generator=gen).squeeze(1) for q in (q0, q1))
    else:
        x0 = torch.multinomial(q0, 1, generator=gen).squeeze(1)
        q1 = q0.scatter(1, x0[:, None], 0)
        q1 = q1 / q1.sum(-1, keepdim=True)
        x1 = torch.multinomial(q1, 1, generator=gen).squeeze(1)
    q2 = Q[x0]
    x2 = q2.argmax(-1) if mode == "top-k" else torch.multinomial(q2, 1, generator=gen).squeeze(1)
    tokens = torch.stack([x0, x1, x2], 1)
    draft = None if mode == "top-k" else torch.stack([q0, q1, q2], 1)
    target = torch.stack([P[context], P[x0], P[x1], P[x2]], 1)
    accepted, nxt = verify_trees(TREE.expand(B, 3), tokens, draft, target, gen)
    path_ok = ~accepted[:, 2] | accepted[:, 0]  # a grandchild only under an accepted parent
    assert path_ok.all() and not (accepted[:, 0] & accepted[:, 1]).any()
    return pad_emitted(tokens, accepted, nxt)


def first_two(step, context):
    """The first two tokens generated from each context: a second step where the first emitted one."""
    e = step(context)
    second = e[:, 1].clone()
    need = second < 0
    second[need] = step(e[need, 0])[:, 0]
    return e[:, 0], second


# --------------------------------------------------------------------------- the fit test
def chi_square_p(samples: torch.Tensor, expected: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of `samples` (cell indices) against the probabilities
    `expected`; cells of probability 0 must be empty. P(χ²_df ≥ s) = Q(df/2, s/2), the regularised upper
    incomplete gamma function."""
    counts = torch.bincount(samples, minlength=len(expected)).double()
    assert counts[expected == 0].sum() == 0, "a token the target gives probability 0 was emitted"
    e = expected[expected > 0] * len(samples)
    assert e.min() >= 20, "cells too small for the chi-square approximation"
    stat = ((counts[expected > 0] - e) ** 2 / e).sum()
    df = torch.tensor((expected > 0).sum().item() - 1.0, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def check_fit(P, step, c0=1):
    """First token ~ P[c0]; first two ~ P[c0][t1] P[t1][t2]."""
    t1, t2 = first_two(step, torch.full((N,), c0))
    assert chi_square_p(t1, P[c0]) > P_MIN
    assert chi_square_p(t1 * V + t2, (P[c0][:, None] * P).flatten()) > P_MIN


def test_chi_square_p_is_right():
    scipy_stats = pytest.importorskip("scipy.stats")
    gen = torch.Generator().manual_seed(3)
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    samples = torch.multinomial(probs, 2000, replacement=True, generator=gen)
    counts = torch.bincount(samples, minlength=4).double()
    want = scipy_stats.chisquare(counts.numpy(), (probs * 2000).numpy()).pvalue
    assert chi_square_p(samples, probs) == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("case", list(CASES))
def test_chain_emits_the_targets_distribution(case):
    P, Q = CASES[case]
    gen = torch.Generator().manual_seed(1)
    check_fit(P, lambda ctx: chain_step(P, Q, ctx, gen))


def test_chain_with_deterministic_proposals_emits_the_targets_distribution():
    P, Q = CASES["random draft"]
    gen = torch.Generator().manual_seed(2)
    check_fit(P, lambda ctx: chain_step(P, Q, ctx, gen, deterministic=True))


def test_chain_accepts_the_first_draft_with_probability_sum_min_p_q():
    P, Q = CASES["random draft"]
    gen = torch.Generator().manual_seed(4)
    e = chain_step(P, Q, torch.full((N,), 2), gen)
    beta = torch.minimum(P[2], Q[2]).sum().item()  # Leviathan's β: the expected acceptance rate
    got = (e[:, 1] >= 0).double().mean().item()
    assert abs(got - beta) < 5 * (beta * (1 - beta) / N) ** 0.5


def test_draft_equal_to_target_is_always_accepted():
    P, _ = CASES["random draft"]
    gen = torch.Generator().manual_seed(5)
    e = chain_step(P, P, torch.full((20_000,), 0), gen)
    assert (e >= 0).all()  # all K drafts and the bonus token, every time


def test_disjoint_supports_reject_every_draft():
    P, Q = CASES["disjoint supports"]
    e = chain_step(P, Q, torch.full((20_000,), 0), torch.Generator().manual_seed(6))
    assert (e[:, 1:] == -1).all()


def test_a_wrong_rule_fails_the_same_fit_test():
    """Rejections resampled from p instead of norm(max(0, p − q)): the first token is then distributed
    as min(p, q) + (1 − β) p, and the test sees it."""
    P, Q = CASES["random draft"]
    gen = torch.Generator().manual_seed(7)
    p, q = P[1].expand(N, V), Q[1].expand(N, V)
    x = torch.multinomial(q, 1, generator=gen).squeeze(1)
    keep = torch.rand(N, generator=gen, dtype=torch.float64) < p[0, x] / q[0, x]
    wrong = torch.where(keep, x, torch.multinomial(p, 1, generator=gen).squeeze(1))
    assert chi_square_p(wrong, P[1]) < P_MIN


@pytest.mark.parametrize("mode", ["independent", "without replacement", "top-k"])
@pytest.mark.parametrize("case", ["random draft", "draft mass where the target has none",
                                  "disjoint supports", "draft equals target"])
def test_tree_emits_the_targets_distribution(case, mode):
    P, Q = CASES[case]
    gen = torch.Generator().manual_seed(8)
    check_fit(P, lambda ctx: tree_step(P, Q, ctx, gen, mode))


# --------------------------------------------------------------------------- greedy
def test_chain_greedy_returns_the_argmax_path():
    argmax = torch.tensor([4, 1, 5, 2])
    assert verify_chain_greedy(torch.tensor([4, 1, 5]), argmax).tolist() == [4, 1, 5, 2]  # bonus
    assert verify_chain_greedy(torch.tensor([3, 1, 5]), argmax).tolist() == [4]  # first rejected
    assert verify_chain_greedy(torch.tensor([4, 1, 0]), argmax).tolist() == [4, 1, 5]
    assert verify_chain_greedy(torch.tensor([], dtype=torch.long), argmax[:1]).tolist() == [4]


def test_chain_greedy_batched_matches_a_plain_loop():
    gen = torch.Generator().manual_seed(9)
    argmax = torch.randint(0, 3, (500, K + 1), generator=gen)
    drafts = torch.where(torch.rand(500, K, generator=gen) < 0.7, argmax[:, :K], 0)
    n, nxt = verify_chains_greedy(drafts, argmax)
    for b in range(500):
        m = 0
        while m < K and drafts[b, m] == argmax[b, m]:
            m += 1
        assert (n[b].item(), nxt[b].item()) == (m, argmax[b, m].item())


def test_one_hot_probabilities_give_the_greedy_path():
    """Greedy is speculative sampling with one-hot p and q: whatever the draws, the argmax path."""
    gen = torch.Generator().manual_seed(10)
    argmax = torch.tensor([4, 1, 5, 2])
    one_hot = torch.nn.functional.one_hot(argmax, V).double()
    for drafts in ([4, 1, 5], [3, 1, 5], [4, 1, 0], [4, 0, 0]):
        d = torch.tensor(drafts)
        want = verify_chain_greedy(d, argmax).tolist()
        for _ in range(20):
            assert verify_chain(d, None, one_hot, gen).tolist() == want
    parents, tokens = torch.tensor([-1, -1, 0, 1]), torch.tensor([3, 4, 0, 1])
    target = one_hot[[0, 0, 1, 0, 2]]  # argmax 4 at the root, 1 after node 1, 5 after node 3
    want = [t.tolist() for t in verify_tree_greedy(parents, tokens, target.argmax(-1))]
    assert want == [[4, 1, 5], [1, 3]]
    for _ in range(20):
        assert [t.tolist() for t in verify_tree(parents, tokens, None, target, gen)] == want


def test_tree_greedy_returns_the_argmax_path_and_its_nodes():
    parents, tokens = TREE, torch.tensor([5, 2, 3])
    cases = {  # target_argmax rows: the root, after node 0, after node 1, after node 2
        (5, 3, 0, 1): ([5, 3, 1], [0, 2]),  # to the leaf, then the bonus token
        (2, 0, 4, 0): ([2, 4], [1]),  # the second child
        (5, 1, 0, 0): ([5, 1], [0]),  # the grandchild rejected
        (4, 3, 0, 1): ([4], []),  # every child of the root rejected
    }
    for argmax, (emitted, nodes) in cases.items():
        got = verify_tree_greedy(parents, tokens, torch.tensor(argmax))
        assert (got[0].tolist(), got[1].tolist()) == (emitted, nodes)


def reference_tree_greedy(parents: list[int], tokens: list[int], argmax: list[int]):
    node, path = -1, []
    while True:
        child = next((i for i, p in enumerate(parents) if p == node and tokens[i] == argmax[node + 1]), None)
        if child is None:
            return [tokens[i] for i in path] + [argmax[node + 1]], path
        node, path = child, [*path, child]


def test_tree_greedy_batched_matches_a_walk_and_a_chain_is_a_tree():
    gen = torch.Generator().manual_seed(11)
    B, n = 300, 7
    parents = torch.stack([torch.tensor([-1] + [int(torch.randint(-1, i, (1,), generator=gen))
                                                for i in range(1, n)]) for _ in range(B)])
    tokens = torch.randint(0, 3, (B, n), generator=gen)
    argmax = torch.randint(0, 3, (B, n + 1), generator=gen)
    accepted, nxt = verify_trees_greedy(parents, tokens, argmax)
    for b in range(B):
        emitted, path = reference_tree_greedy(parents[b].tolist(), tokens[b].tolist(), argmax[b].tolist())
        assert accepted[b].nonzero().squeeze(1).tolist() == path
        assert [*tokens[b][accepted[b]].tolist(), nxt[b].item()] == emitted
    chain = torch.arange(-1, n - 1).expand(B, n)
    accepted, nxt = verify_trees_greedy(chain, tokens, argmax)
    n_chain, nxt_chain = verify_chains_greedy(tokens, argmax)
    assert (accepted.sum(1) == n_chain).all() and (nxt == nxt_chain).all()


# --------------------------------------------------------------------------- details
def test_residual_of_equal_distributions_keeps_p():
    p = CASES["random draft"][0][:2]
    assert torch.equal(residual(p, p), p)
    q = torch.tensor([[0.5, 0.5, 0, 0, 0, 0]], dtype=torch.float64)
    r = residual(torch.full((1, V), 1 / V, dtype=torch.float64), q)
    assert torch.allclose(r, torch.tensor([[0, 0, 0.25, 0.25, 0.25, 0.25]], dtype=torch.float64))


def test_a_generator_per_row_makes_a_row_independent_of_its_batch():
    P, Q = CASES["random draft"]
    drafts = torch.tensor([[0, 1, 2], [3, 4, 5]])
    q = torch.stack([Q[[1, 0, 1]], Q[[2, 3, 4]]])
    p = torch.stack([P[[1, 0, 1, 2]], P[[2, 3, 4, 5]]])
    for seed in range(20):
        alone = verify_chain(drafts[0], q[0], p[0], torch.Generator().manual_seed(seed))
        gens = [torch.Generator().manual_seed(seed), torch.Generator().manual_seed(99)]
        n, nxt = verify_chains(drafts, q, p, gens)
        assert alone.tolist() == [*drafts[0, : n[0]].tolist(), nxt[0].item()]
        tree = verify_tree(TREE, drafts[0], q[0], p[0], torch.Generator().manual_seed(seed))
        gens = [torch.Generator().manual_seed(seed), torch.Generator().manual_seed(99)]
        accepted, nxt = verify_trees(TREE.expand(2, 3), drafts, q, p, gens)
        assert tree[0].tolist() == [*drafts[0][accepted[0]].tolist(), nxt[0].item()]


def test_bad_inputs_raise_errors_naming_the_argument():
    p = torch.full((K + 1, V), 1 / V)
    q = torch.full((K, V), 1 / V)
    d = torch.tensor([0, 1, 2])
    with pytest.raises(TypeError, match="draft_tokens must be a torch.Tensor"):
        verify_chain([0, 1, 2], q, p)
    with pytest.raises(TypeError, match=r"draft_tokens must have torch.long"):
        verify_chain(d.int(), q, p)
    with pytest.raises(TypeError, match="target_probs must have a floating dtype"):
        verify_chain(d, q, torch.ones(K + 1, V, dtype=torch.long))
    with pytest.raises(ValueError, match=r"target_probs must have shape \[4, \*\], got \[3, 6\]"):
        verify_chain(d, q, p[:K])
    with pytest.raises(ValueError, match=r"draft_probs must have shape \[3, 6\]"):
        verify_chain(d, q[:, :5], p)
    with pytest.raises(ValueError, match="target_probs rows must be probability distributions"):
        verify_chain(d, q, torch.randn(K + 1, V))  # logits
    with pytest.raises(ValueError, match="draft_probs rows must be probability distributions"):
        verify_chain(d, q * 2, p)
    with pytest.raises(ValueError, match=r"draft_tokens must lie in \[0, 6\)"):
        verify_chain(torch.tensor([0, 6, 1]), q, p)
    with pytest.raises(ValueError, match=r"draft_tokens must lie in \[0, 6\)"):
        verify_chain(torch.tensor([0, -1, 1]), None, p)
    zero = q.clone()
    zero[1] = torch.tensor([0.5, 0, 0.5, 0, 0, 0])  # draft 1 is token 1, which q_1 never proposes
    with pytest.raises(ValueError, match="draft_tokens holds a token its draft_probs give probability 0"):
        verify_chain(d, zero, p)
    with pytest.raises(ValueError, match=r"generator must be a torch.Generator, None, or one per row \(2\)"):
        verify_chains(d.expand(2, K), q.expand(2, K, V), p.expand(2, K + 1, V), [torch.Generator()])
    with pytest.raises(ValueError, match=r"target_argmax must have shape \[4\]"):
        verify_chain_greedy(d, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"parents\[:, i\] must lie in \[-1, i\)"):
        verify_tree(torch.tensor([-1, 1, 0]), d, q, p)
    with pytest.raises(ValueError, match=r"parents\[:, i\] must lie in \[-1, i\)"):
        verify_tree_greedy(torch.tensor([-2, -1, 0]), d, torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match=r"tokens must have shape \[3\]"):
        verify_tree(TREE, d[:2], q, p)
    with pytest.raises(ValueError, match=r"tokens holds a token its draft_probs give probability 0"):
        verify_tree(TREE, d, zero, p)
    with pytest.raises(ValueError, match=r"target_probs must have shape \[2, 4, \*\]"):
        verify_trees(TREE.expand(2, 3), d.expand(2, 3), None, p[:3].expand(2, 3, V))
