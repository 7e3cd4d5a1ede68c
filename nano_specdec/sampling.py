"""Verification: which drafted tokens the target keeps, and the one token it adds.

Speculative sampling (Leviathan et al. 2023, arXiv 2211.17192, §2.3 and Algorithm 1; Chen et al. 2023,
arXiv 2302.01318, Algorithm 2). A draft proposes x ~ q; the target's distribution at the same position is
p. Accept x with probability min(1, p(x)/q(x)); at the first rejection emit one token drawn from the
residual norm(max(0, p − q)) and stop; when all k drafts are accepted, emit a bonus token from the
target's row k. Why the output is exactly p (Leviathan Appendix A.1, Chen Theorem 1): with
β = Σ_x min(p(x), q(x)) the probability that a draft is accepted, and Σ_x max(0, p(x) − q(x)) = 1 − β,

    P(emit x) = q(x) min(1, p(x)/q(x)) + (1 − β) max(0, p(x) − q(x)) / (1 − β)
              = min(p(x), q(x)) + max(0, p(x) − q(x)) = p(x).

The same argument at each accepted position makes the whole emitted sequence distributed as the target's
own samples. Greedy decoding is the case of one-hot p and q; it is written out separately
(`verify_chain_greedy`): it draws no random numbers and emits exactly the target's argmax path.

Draft trees (Medusa, arXiv 2401.10774; EAGLE-2, arXiv 2406.16858) are verified with SpecInfer's
multi-step speculative sampling (Miao et al. 2023, arXiv 2305.09781, Algorithm 2): from the root, test
the children of the current node one by one against the target's distribution p at that node; a child
that passes is accepted and becomes the current node (p := its own target row); a rejected child x turns
p into norm(max(0, p − q_x)) for the next sibling; when no child passes, emit one token from p. Each test
is the rule above against the distribution still unaccounted for, so the output is again exactly the
target's — provided `draft_probs[i]` is the distribution node i was drawn from given its parent and its
earlier siblings: the draft's own distribution for independent draws (SpecInfer), that distribution with
the earlier siblings' tokens removed and renormalised for draws without replacement (Recursive
Speculative Decoding, arXiv 2402.14160), and one-hot (`draft_probs=None`) for tokens chosen
deterministically — top-k children, Medusa's static tree, prompt lookup. The greedy tree rule descends
while some child equals the target's argmax, and emits the argmax where it stops. Medusa's "typical
acceptance" keeps tokens the target finds merely plausible and so changes the output distribution; this
package uses the exact rule (temperature > 0) and the greedy rule (temperature 0) instead.

Every rule comes twice: batched over requests (`verify_chains`, `verify_trees` and their greedy twins,
what an engine calls: they return how much was accepted and the one extra token per row) and for one
request (`verify_chain`, `verify_tree`, ...: the emitted tokens). Probabilities are the target's and the
draft's after temperature / top-k / top-p; rows must be distributions. `generator` is one
torch.Generator, one per row (a seeded request's own), or None (torch's global generator).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

Generators = torch.Generator | Sequence[torch.Generator | None] | None


# --------------------------------------------------------------------------- checks and draws
def _check(name: str, t: object, shape: tuple, floating: bool) -> torch.Tensor:
    """`t` as a tensor of `shape` (None: any size) and kind; TypeError / ValueError naming `name`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if floating != t.is_floating_point() or (not floating and t.dtype != torch.long):
        want = "a floating dtype" if floating else "torch.long"
        raise TypeError(f"{name} must have {want}, got {t.dtype}")
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    return t


def _check_distributions(name: str, probs: torch.Tensor) -> None:
    """Rows of probabilities (logits or unnormalised scores passed by mistake fail here)."""
    total = probs.float().sum(-1)
    if not (bool((probs >= 0).all()) and bool(((total - 1).abs() < 1e-2).all())):
        raise ValueError(f"{name} rows must be probability distributions "
                         "(non-negative, summing to 1)")


def _check_tokens(name: str, tokens: torch.Tensor, vocab: int) -> None:
    if not bool(((tokens >= 0) & (tokens < vocab)).all()):
        raise ValueError(f"{name} must lie in [0, {vocab}) (the vocabulary of the probabilities)")


def _draft(name: str, tokens: torch.Tensor, draft_probs: torch.Tensor | None,
           shape: tuple, like: torch.Tensor) -> torch.Tensor:
    """The distributions the drafts were drawn from: `draft_probs`, or one-hot where None (a
    deterministic proposal). A token its draft gave probability 0 cannot have been drawn from it, and
    min(1, p/q) would be undefined: an error, not a guess."""
    if draft_probs is None:
        return F.one_hot(tokens, like.shape[-1]).to(like.dtype)
    _check("draft_probs", draft_probs, shape, floating=True)
    _check_distributions("draft_probs", draft_probs)
    if not bool((draft_probs.gather(-1, tokens[..., None]) > 0).all()):
        raise ValueError(f"{name} holds a token its draft_probs give probability 0: it cannot have "
                         "been drawn from them (pass the distribution it was drawn from)")
    return draft_probs


def _check_generator(generator: Generators, rows: int) -> None:
    if generator is None or isinstance(generator, torch.Generator):
        return
    if not isinstance(generator, Sequence) or len(generator) != rows:
        raise ValueError(f"generator must be a torch.Generator, None, or one per row ({rows})")


def _uniform(shape: tuple[int, int], generator: Generators, device: torch.device) -> torch.Tensor:
    """U[0, 1) draws; row b from generator[b] when there is one generator per row."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand(shape, generator=generator, device=device)
    return torch.stack([torch.rand(shape[1:], generator=g, device=device) for g in generator])


def _sample(probs: torch.Tensor, generator: Generators) -> torch.Tensor:
    """One token per row of `probs` [B, V]."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return torch.cat([torch.multinomial(p[None], 1, generator=g)[0]
                      for p, g in zip(probs, generator)])


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p − q)) per row: what is left of p once q's accepted mass is taken out. All zeros
    only where p == q, where a rejection has probability 0 (it can still happen by rounding): keep p."""
    r = (p - q).clamp(min=0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=torch.finfo(r.dtype).tiny), p)


# --------------------------------------------------------------------------- chains
def verify_chains(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                  target_probs: torch.Tensor, generator: Generators = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling for a batch of chains (Leviathan Algorithm 1, Chen Algorithm 2).

    draft_tokens [B, k] long; draft_probs [B, k, V], row i the distribution draft i was drawn from
    (None: drafts proposed deterministically, q one-hot); target_probs [B, k + 1, V], row i the target's
    distribution after the first i drafts. Returns (num_accepted [B], next_tokens [B]): row b emits
    draft_tokens[b, :num_accepted[b]] and then next_tokens[b].
    """
    _check("draft_tokens", draft_tokens, (None, None), floating=False)
    B, k = draft_tokens.shape
    _check("target_probs", target_probs, (B, k + 1, None), floating=True)
    V = target_probs.shape[-1]
    _check_distributions("target_probs", target_probs)
    _check_tokens("draft_tokens", draft_tokens, V)
    draft_probs = _draft("draft_tokens", draft_tokens, draft_probs, (B, k, V), target_probs)
    _check_generator(generator, B)

    x = draft_tokens[..., None]
    p_x = target_probs[:, :k].gather(2, x).squeeze(2)  # p(x_i) and q(x_i), [B, k]
    q_x = draft_probs.gather(2, x).squeeze(2)
    r = _uniform((B, k), generator, draft_tokens.device)
    accepted = r < p_x / q_x  # r ~ U[0, 1): true with probability min(1, p(x)/q(x))
    num_accepted = accepted.long().cumprod(1).sum(1)  # the prefix before the first rejection
    # at the first rejection n < k: draw from norm(max(0, p_n − q_n)); with all k accepted, q_k := 0,
    # so the same line draws the bonus token from the target's last row
    q = torch.cat([draft_probs, draft_probs.new_zeros(B, 1, V)], 1)
    rows = torch.arange(B, device=draft_tokens.device)
    last = residual(target_probs[rows, num_accepted], q[rows, num_accepted])
    return num_accepted, _sample(last, generator)


def verify_chains_greedy(draft_tokens: torch.Tensor, target_argmax: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of a batch of chains: drafts are kept while they equal the target's argmax.

    draft_tokens [B, k] long; target_argmax [B, k + 1] long, the target's argmax after the first i
    drafts. Returns (num_accepted [B], next_tokens [B]) as `verify_chains` does; no random draws.
    """
    _check("draft_tokens", draft_tokens, (None, None), floating=False)
    B, k = draft_tokens.shape
    _check("target_argmax", target_argmax, (B, k + 1), floating=False)
    num_accepted = (draft_tokens == target_argmax[:, :k]).long().cumprod(1).sum(1)
    rows = torch.arange(B, device=draft_tokens.device)
    return num_accepted, target_argmax[rows, num_accepted]


def verify_chain(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                 target_probs: torch.Tensor, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
    """Speculative sampling for one request: draft_tokens [k], draft_probs [k, V] (or None: one-hot),
    target_probs [k + 1, V]. Returns the emitted tokens, 1 to k + 1 of them: the accepted drafts and
    one token from the residual (or the bonus token when all k are accepted)."""
    k = _check("draft_tokens", draft_tokens, (None,), floating=False).shape[0]
    V = _check("target_probs", target_probs, (k + 1, None), floating=True).shape[1]
    if draft_probs is not None:
        draft_probs = _check("draft_probs", draft_probs, (k, V), floating=True)[None]
    n, nxt = verify_chains(draft_tokens[None], draft_probs, target_probs[None], generator)
    return torch.cat([draft_tokens[: int(n)], nxt])


def verify_chain_greedy(draft_tokens: torch.Tensor, target_argmax: torch.Tensor) -> torch.Tensor:
    """Greedy verification of one chain: draft_tokens [k], target_argmax [k + 1]. Returns the emitted
    tokens: the target's argmax path up to and including its first disagreement with the draft."""
    k = _check("draft_tokens", draft_tokens, (None,), floating=False).shape[0]
    _check("target_argmax", target_argmax, (k + 1,), floating=False)
    n, _ = verify_chains_greedy(draft_tokens[None], target_argmax[None])
    return target_argmax[: int(n) + 1]


# --------------------------------------------------------------------------- trees
def _check_tree(parents: torch.Tensor, tokens: torch.Tensor) -> tuple[int, int]:
    """Nodes in an order where each parent comes before its children: -1 <= parents[:, i] < i."""
    _check("tokens", tokens, (None, None), floating=False)
    B, n = tokens.shape
    _check("parents", parents, (B, n), floating=False)
    index = torch.arange(n, device=parents.device)
    if not bool(((parents >= -1) & (parents < index)).all()):
        raise ValueError("parents[:, i] must lie in [-1, i): -1 for the root's children, else an "
                         "earlier node (a parent before its children)")
    return B, n


def verify_trees(parents: torch.Tensor, tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                 target_probs: torch.Tensor, generator: Generators = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-step speculative sampling over a batch of draft trees (SpecInfer Algorithm 2).

    parents [B, n] long (-1: a child of the root, the last accepted token); tokens [B, n] long;
    draft_probs [B, n, V], row i the distribution node i was drawn from given its parent and earlier
    siblings (None: chosen deterministically, q one-hot); target_probs [B, n + 1, V]: row 0 the target's
    distribution at the root, row i + 1 after the path ending at node i. Siblings are tested in node
    order. Returns (accepted [B, n] bool, the accepted path; next_tokens [B]): row b emits
    tokens[b][accepted[b]] and then next_tokens[b].
    """
    B, n = _check_tree(parents, tokens)
    _check("target_probs", target_probs, (B, n + 1, None), floating=True)
    V = target_probs.shape[-1]
    _check_distributions("target_probs", target_probs)
    _check_tokens("tokens", tokens, V)
    draft_probs = _draft("tokens", tokens, draft_probs, (B, n, V), target_probs)
    _check_generator(generator, B)

    rows = torch.arange(B, device=tokens.device)
    node = torch.full((B,), -1, dtype=torch.long, device=tokens.device)  # -1: the root
    p = target_probs[:, 0]  # the target's distribution at `node`, less the siblings rejected so far
    accepted = torch.zeros(B, n, dtype=torch.bool, device=tokens.device)
    r = _uniform((B, n), generator, tokens.device)
    for i in range(n):  # node order visits the current node's children in turn, then theirs
        tried = parents[:, i] == node
        x, q = tokens[:, i], draft_probs[:, i]
        ok = tried & (r[:, i] < p[rows, x] / q[rows, x])  # min(1, p(x)/q(x)) against what is left
        rejected = tried & ~ok
        p = torch.where(ok[:, None], target_probs[:, i + 1],
                        torch.where(rejected[:, None], residual(p, q), p))
        node = torch.where(ok, i, node)
        accepted[:, i] = ok
    return accepted, _sample(p, generator)  # the bonus token, or one from the last residual


def verify_trees_greedy(parents: torch.Tensor, tokens: torch.Tensor, target_argmax: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy tree rule over a batch: from the root, descend to the first child (in node order)
    equal to the target's argmax at the current node; stop where none is. target_argmax [B, n + 1]:
    row 0 at the root, row i + 1 after node i. Returns (accepted [B, n], next_tokens [B]) as
    `verify_trees` does; no random draws."""
    B, n = _check_tree(parents, tokens)
    _check("target_argmax", target_argmax, (B, n + 1), floating=False)
    rows = torch.arange(B, device=tokens.device)
    node = torch.full((B,), -1, dtype=torch.long, device=tokens.device)
    accepted = torch.zeros(B, n, dtype=torch.bool, device=tokens.device)
    for i in range(n):
        ok = (parents[:, i] == node) & (tokens[:, i] == target_argmax[rows, node + 1])
        node = torch.where(ok, i, node)
        accepted[:, i] = ok
    return accepted, target_argmax[rows, node + 1]


def _one_tree(parents: torch.Tensor, tokens: torch.Tensor) -> int:
    n = _check("parents", parents, (None,), floating=False).shape[0]
    return _check("tokens", tokens, (n,), floating=False).shape[0]


def verify_tree(parents: torch.Tensor, tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                target_probs: torch.Tensor, generator: torch.Generator | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-step speculative sampling for one draft tree: parents [n], tokens [n], draft_probs [n, V]
    (or None: one-hot), target_probs [n + 1, V]. Returns (the emitted tokens, the accepted nodes in
    path order): the engine keeps those nodes' K/V."""
    n = _one_tree(parents, tokens)
    V = _check("target_probs", target_probs, (n + 1, None), floating=True).shape[1]
    if draft_probs is not None:
        draft_probs = _check("draft_probs", draft_probs, (n, V), floating=True)[None]
    accepted, nxt = verify_trees(parents[None], tokens[None], draft_probs, target_probs[None],
                                 generator)
    return torch.cat([tokens[accepted[0]], nxt]), accepted[0].nonzero().squeeze(1)


def verify_tree_greedy(parents: torch.Tensor, tokens: torch.Tensor, target_argmax: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy tree rule for one tree: parents [n], tokens [n], target_argmax [n + 1]. Returns (the
    emitted tokens — the target's argmax path —, the accepted nodes in path order)."""
    n = _one_tree(parents, tokens)
    _check("target_argmax", target_argmax, (n + 1,), floating=False)
    accepted, nxt = verify_trees_greedy(parents[None], tokens[None], target_argmax[None])
    return torch.cat([tokens[accepted[0]], nxt]), accepted[0].nonzero().squeeze(1)
