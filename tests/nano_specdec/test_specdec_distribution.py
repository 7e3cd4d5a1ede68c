"""Sampled output through the engine is distributed as the target's (Leviathan Appendix A.1, Chen
Theorem 1): on a toy target over 16 tokens with a strongly different draft model, many seeded requests
(temperature 0.8, top-p 0.9) each emit four tokens — the first from the prefill, then two drafts per
verification. The counts of the second and third tokens are compared, by a chi-square
goodness-of-fit test at a fixed seed (failing below p = 1e-4), with what the target itself gives after
each request's first token: Σ_r p(· | prompt, o0_r), and Σ_r Σ_b p(b | prompt, o0_r) p(· | prompt, o0_r,
b), computed with transformers. The plain engine passes the same test, and a verification that keeps
every draft (the draft's distribution, not the target's) fails it."""

from __future__ import annotations

import pytest
import torch

import nano_specdec.model_runner as spec_runner
from nano_specdec import LLM
from nano_specdec.proposers import request_probs
from nano_vllm import LLM as PlainLLM
from nano_vllm import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT, N, V, P_MIN = [1, 2, 3], 1500, 16, 1e-4
PARAMS = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=4) for i in range(N)]
ARGS = dict(device="cpu", num_kv_blocks=2 * N + 8, max_num_seqs=512, max_model_len=32)


def chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's chi-square p-value of `counts` against `expected` counts; cells expected below 5 are
    pooled into one."""
    small = expected < 5
    assert counts[expected == 0].sum() == 0, "a token the target gives probability 0 was emitted"
    c = torch.cat([counts[~small], counts[small].sum()[None]])
    e = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = e > 0
    stat = ((c[keep] - e[keep]) ** 2 / e[keep]).sum()
    df = torch.tensor(float(keep.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


@pytest.fixture(scope="module")
def target_probs(toy_pair):
    """p(· | prompt, a) [V, V] and p(· | prompt, a, b) [V, V, V] as the requests sample them."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(toy_pair[0]).eval()
    a, b = torch.arange(V).repeat_interleave(V), torch.arange(V).repeat(V)
    ids = torch.cat([torch.tensor(PROMPT).expand(V * V, -1), a[:, None], b[:, None]], 1)
    with torch.no_grad():
        logits = model(ids).logits.double()
    sp = PARAMS[0]
    p1 = request_probs(logits[::V, -2], sp).double()  # after prompt + a
    p2 = request_probs(logits[:, -1], sp).double().view(V, V, V)  # after prompt + a + b
    return p1, p2


def emitted(llm) -> torch.Tensor:
    outs = llm.generate([PROMPT] * N, PARAMS, use_tqdm=False)
    assert all(len(o.token_ids) == 4 for o in outs)
    return torch.tensor([o.token_ids for o in outs])


def fits(tokens: torch.Tensor, p1: torch.Tensor, p2: torch.Tensor) -> tuple[float, float]:
    o0, o1, o2 = tokens[:, :3].T
    expect1 = p1[o0].sum(0)
    expect2 = torch.einsum("rb,rbv->v", p1[o0], p2[o0])
    return (chi_square_p(torch.bincount(o1, minlength=V).double(), expect1),
            chi_square_p(torch.bincount(o2, minlength=V).double(), expect2))


def test_sampled_tokens_follow_the_target_distribution(toy_pair, target_probs, monkeypatch):
    target, draft = toy_pair
    config = {"method": "draft_model", "num_speculative_tokens": 2, "model": draft}
    llm = LLM(target, speculative_config=config, **ARGS)
    spec = emitted(llm)
    stats = llm.engine.spec_decode_stats
    assert stats.num_draft_tokens >= 2 * N  # two drafts in each first verification
    assert 0 < stats.accepted_by_position[1] < stats.accepted_by_position[0] < N
    assert min(fits(spec, *target_probs)) > P_MIN
    base = emitted(PlainLLM(target, **ARGS))
    assert torch.equal(base[:, 0], spec[:, 0])  # the prefill's token: the same seeded draw
    assert min(fits(base, *target_probs)) > P_MIN

    def keep_every_draft(tokens, q, p, generator):  # the draft's distribution, not the target's
        k = tokens.shape[1]
        return torch.tensor([k]), torch.multinomial(p[0, k], 1, generator=generator)

    monkeypatch.setattr(spec_runner, "verify_chains", keep_every_draft)
    assert min(fits(emitted(LLM(target, speculative_config=config, **ARGS)), *target_probs)) < P_MIN
