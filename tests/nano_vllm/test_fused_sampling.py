"""Fused sampling (nano_vllm.layers.fused_sampling): the Triton kernel (under TRITON_INTERPRET=1 on a CPU) draws
what its torch reference draws; the reference draws from softmax(logits / T) (Gumbel-max); greedy rows are
torch.argmax; top-k / top-p and seeds behave as on the paper path's sampler."""

from __future__ import annotations

import pytest
import torch
from vllm_checkpoints import random_prompts

from nano_vllm import LLM, SamplingParams
from nano_vllm.layers.fused_sampling import (
    _seed32,
    greedy_tokens,
    sample_reference,
    sample_tokens,
    sample_triton,
    vocab_splits,
)


def _rows(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    temps = torch.tensor([0.0, 0.5, 1.0, 2.0] * (n // 4))
    seeds = torch.randint(0, 1 << 32, (n,), generator=g)
    offsets = torch.randint(0, 5000, (n,), generator=g)
    return temps, seeds, offsets


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_draws_what_the_reference_draws(dtype):
    temps, seeds, offsets = _rows(8)
    logits = (3 * torch.randn(8, 3000, generator=torch.Generator().manual_seed(1))).to(dtype)  # 2 vocab blocks
    ours = sample_triton(logits, temps, seeds, offsets)
    assert ours.dtype == torch.int64
    assert ours.tolist() == sample_reference(logits, temps, seeds, offsets).tolist()
    assert ours[::4].tolist() == logits[::4].argmax(-1).tolist()  # temperature 0: greedy


def test_greedy_takes_the_first_maximum():
    logits = torch.zeros(2, 2500)
    logits[:, [7, 2100]] = 5.0
    zero = torch.zeros(2, dtype=torch.int64)
    assert sample_triton(logits, torch.zeros(2), zero, zero).tolist() == [7, 7]
    assert sample_reference(logits, torch.zeros(2), zero, zero).tolist() == [7, 7]


@pytest.mark.parametrize("splits", [2, 3, 5])
def test_split_rows_draw_what_one_program_draws(splits):
    """A row read by several programs (small batches) picks what one program picks: draws, the argmax, and
    the first maximum when equal values sit in different splits."""
    temps, seeds, offsets = _rows(4)
    logits = 3 * torch.randn(4, 5000, generator=torch.Generator().manual_seed(2))
    ref = sample_reference(logits, temps, seeds, offsets).tolist()
    assert sample_triton(logits, temps, seeds, offsets, splits=splits).tolist() == ref
    logits[1, [4999, 1500, 3100]] = 50.0  # ties across splits: the first index wins, as torch.argmax
    logits[2, :] = -2.0
    greedy = sample_triton(logits, None, None, None, splits=splits)
    assert greedy.tolist() == logits.argmax(-1).tolist() and greedy[1] == 1500 and greedy[2] == 0
    assert sample_triton(logits, None, None, None, splits=splits).tolist() == greedy.tolist()  # counters reset


def test_vocab_splits():
    assert vocab_splits(1, 151_936, 132) == 149 and vocab_splits(4, 151_936, 132) == 50
    assert vocab_splits(1, 3000, 132) == 3 and vocab_splits(264, 151_936, 132) == 1
    assert vocab_splits(67, 151_936, 132) == 1 and vocab_splits(66, 151_936, 132) == 4
    assert vocab_splits(512, 151_936, 132) == 1 and greedy_tokens(torch.tensor([[1.0, 3.0, 3.0]])).tolist() == [1]


def test_reference_draws_from_the_softmax():
    """20,000 draws of one row (one seed, consecutive offsets) against softmax(logits / T), within 4.5
    standard deviations of each frequency."""
    n, t = 20_000, 0.7
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -3.0])
    tokens = sample_reference(logits.expand(n, -1), torch.full((n,), t), torch.full((n,), 12345, dtype=torch.int64),
                              torch.arange(n))
    freq = torch.bincount(tokens, minlength=6).double() / n
    p = (logits.double() / t).softmax(-1)
    assert ((freq - p).abs() <= 4.5 * (p * (1 - p) / n).sqrt() + 1e-9).all(), (freq, p)
    other = sample_reference(logits.expand(n, -1), torch.full((n,), t), torch.full((n,), 54321, dtype=torch.int64),
                             torch.arange(n))
    assert (other != tokens).float().mean() > 0.3  # another seed, another stream


def test_dispatch_and_seed_folding():
    temps, seeds, offsets = _rows(4)
    logits = torch.randn(4, 50)
    assert sample_tokens(logits, temps, seeds, offsets).tolist() == sample_reference(logits, temps, seeds,
                                                                                      offsets).tolist()
    assert _seed32(5) == 5 and _seed32((7 << 32) | 5) == 5 ^ (7 * 0x21F0AAAD) % 2**32
    # any int: taken as its low 64 bits (the paper path's generator seed), so -1 is 2**64 - 1
    assert _seed32(-1) == _seed32(2**64 - 1) != _seed32(0) and _seed32(2**64 + 3) == _seed32(3) == 3
    assert all(0 <= _seed32(s) < 2**32 for s in (-(2**200), -7, 2**100 + 3))


def test_engine_top_k_top_p_and_greedy(qwen3_ckpt, hf_greedy):
    prompts = random_prompts(70, [4, 11])
    llm = LLM(qwen3_ckpt, max_model_len=64, fused_sampling=True)
    ref = [hf_greedy(qwen3_ckpt, p, 6) for p in prompts]
    for sp in (SamplingParams(temperature=0.0, max_tokens=6), SamplingParams(temperature=1.5, top_k=1, max_tokens=6),
               SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=6)):
        assert [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == ref
    hot = llm.generate(prompts, SamplingParams(temperature=5.0, max_tokens=6, seed=1), use_tqdm=False)
    assert [o.token_ids for o in hot] != ref  # a hot temperature samples away from the argmax
