"""SamplingParams validation and the device sampler (greedy, temperature, top-k, top-p, seeds)."""

from __future__ import annotations

import threading

import pytest
import torch

from nano_vllm import LLM, SamplingParams
from nano_vllm.sampler import Sampler, SamplingTensors, apply_top_k_top_p


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", "hot"), ("top_p", 0.0),
    ("top_p", 1.5), ("top_k", -2), ("top_k", 1.5), ("max_tokens", 0), ("max_tokens", 2.0),
    ("ignore_eos", 1), ("stop_token_ids", [-1]), ("stop_token_ids", 5), ("seed", "x"),
    ("skip_special_tokens", "yes"),
])  # fmt: skip
def test_sampling_params_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_defaults():
    sp = SamplingParams()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens, sp.ignore_eos, sp.stop_token_ids, sp.seed,
            sp.skip_special_tokens) == (1.0, 1.0, -1, 16, False, None, None, True)  # vLLM's defaults
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=0).top_k == -1


def _sample(logits, params, gens=None):
    st = SamplingTensors.build(params, gens or [None] * len(params), logits.shape[-1], logits.device)
    return Sampler().sample(logits, st)


def test_greedy_and_degenerate_filters_are_argmax():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0))
    best = logits.argmax(-1)
    assert torch.equal(_sample(logits, [SamplingParams(temperature=0)] * 64), best)
    assert torch.equal(_sample(logits, [SamplingParams(temperature=2.0, top_k=1)] * 64), best)
    assert torch.equal(_sample(logits, [SamplingParams(temperature=2.0, top_p=1e-6)] * 64), best)
    mixed = [SamplingParams(temperature=0 if i % 2 else 5.0, top_k=1 if i % 2 else 3) for i in range(64)]
    out = _sample(logits, mixed)
    assert torch.equal(out[1::2], best[1::2])


def test_top_k_top_p_mask_matches_brute_force():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 30, generator=g)
    ks = torch.tensor([1, 2, 5, 30, 30, 3, 10, 30])
    ps = torch.tensor([1.0, 1.0, 1.0, 0.5, 0.9, 0.3, 0.8, 1.0])
    masked = apply_top_k_top_p(logits, ks, ps)
    for row in range(8):
        order = logits[row].argsort(descending=True).tolist()
        keep = set(order[: ks[row]])
        probs = logits[row].masked_fill(~torch.isin(torch.arange(30), torch.tensor(sorted(keep))), -torch.inf)
        probs = probs.softmax(-1)
        nucleus, mass = set(), 0.0
        for t in order:
            if t not in keep or mass >= ps[row]:
                break
            nucleus.add(t)
            mass += probs[t].item()
        assert set(torch.isfinite(masked[row]).nonzero().flatten().tolist()) == nucleus, row


def test_temperature_sampling_follows_the_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]]).repeat(40000, 1)
    for temp in (1.0, 0.5):
        tokens = _sample(logits, [SamplingParams(temperature=temp)] * 40000)
        freq = torch.bincount(tokens, minlength=5).float() / 40000
        want = (logits[0] / temp).softmax(-1)
        assert torch.allclose(freq, want, atol=0.01), (temp, freq, want)
    tokens = _sample(logits[:4000], [SamplingParams(temperature=1.0, top_k=2)] * 4000)
    assert set(tokens.tolist()) == {0, 1}


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(3))
    sp = SamplingParams(temperature=1.0, seed=1234)

    def run(rows, seeded_row):
        gens = [torch.Generator().manual_seed(1234) if r == seeded_row else None for r in range(len(rows))]
        params = [sp if r == seeded_row else SamplingParams(temperature=1.0) for r in range(len(rows))]
        return next(int(_sample(logits[rows], params, gens)[seeded_row]) for _ in range(1))

    alone = run([2], 0)
    assert run([0, 1, 2, 3], 2) == alone and run([2, 5], 0) == alone


def test_seeded_requests_reproduce_through_the_engine():
    llm = LLM("tiny", max_model_len=64, seed=0)
    prompt = [5, 6, 7, 8, 9]
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=7)
    alone = llm.generate([prompt], sp, use_tqdm=False)[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=12)] * 3
    batch = llm.generate([[1, 2], prompt, [3] * 20, [4]], [others[0], sp, *others[1:]], use_tqdm=False)
    assert batch[1].token_ids == alone
    other_seed = llm.generate([prompt], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=8),
                              use_tqdm=False)[0].token_ids
    assert other_seed != alone


@pytest.mark.parametrize("layers", [{"performance_layers": False}, {"fused_sampling": True}],
                         ids=["paper_path", "fused_sampling"])
def test_any_int_is_a_seed(layers):
    """vLLM's API takes any int as a seed: a negative one or one wider than 64 bits is its low 64 bits
    (`seed & (2**64 - 1)`), on the paper path's generators and in the fused layer's fold. The requests run
    on a thread joined with a generous deadline, so a fold that never returns fails instead of hanging."""
    llm = LLM("tiny", max_model_len=64, **layers)
    seeds = [-1, 2**64 - 1, 2**70 + 9, 9, -(2**70), 0, 3]
    outs: dict[int, list[int]] = {}

    def run() -> None:
        for seed in seeds:
            sp = SamplingParams(temperature=1.0, max_tokens=8, seed=seed)
            outs[seed] = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].token_ids

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), f"generation with seeds {seeds} did not finish"
    assert len(outs) == len(seeds) and all(len(o) == 8 for o in outs.values())
    assert outs[-1] == outs[2**64 - 1] and outs[2**70 + 9] == outs[9] and outs[-(2**70)] == outs[0]
    assert outs[0] != outs[3]  # distinct seeds stay distinct streams
