"""Sampling the next token on the device: greedy, temperature, top-k, top-p, per-request seeds.

The whole batch is sampled with a handful of tensor ops and no host sync until the tokens are read:

* greedy rows (temperature 0) take the argmax of the raw logits;
* the others divide by their temperature, mask tokens outside their top-k / top-p (one descending sort,
  only when some row asks for it), and sample with the "exponential race": argmax(p_i / E_i) with
  E_i ~ Exp(1) picks token i with probability p_i (Gumbel-max in disguise), which needs no multinomial
  call and no sync;
* a request with a seed draws its E from its own generator, so its tokens do not depend on what else is
  in the batch. Any int is a seed (vLLM's API takes any): `seed64` folds it into the 64 bits a generator
  takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nano_vllm.sampling_params import SamplingParams

SEED_BITS = 2**64 - 1


def seed64(seed: int) -> int:
    """A request's seed as a generator's unsigned 64-bit seed: `seed & (2**64 - 1)`, so -1 is 2**64 - 1
    and an int wider than 64 bits keeps its low 64 bits."""
    return seed & SEED_BITS


@dataclass
class SamplingTensors:
    """Per-row parameters of one batch, on the device."""

    temperatures: torch.Tensor  # (B,) fp32, 0 = greedy
    top_ks: torch.Tensor  # (B,) int64, vocab size = off
    top_ps: torch.Tensor  # (B,) fp32, 1 = off
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    generators: list[torch.Generator | None]

    @classmethod
    def build(cls, params: list[SamplingParams], generators: list[torch.Generator | None], vocab_size: int,
              device: torch.device) -> SamplingTensors:
        temps = [p.temperature for p in params]
        top_ks = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        top_ps = [p.top_p for p in params]
        # One host array, one copy (this runs every step): rows temperature, top-k, top-p. fp64 holds
        # any vocabulary index exactly.
        host = torch.from_numpy(np.array([temps, top_ks, top_ps], dtype=np.float64))
        if device.type == "cuda":
            host = host.pin_memory()
        dev = host.to(device, non_blocking=True)
        return cls(dev[0].float(), dev[1].long(), dev[2].float(),
                   all(t == 0.0 for t in temps),
                   any(k < vocab_size for k, t in zip(top_ks, temps) if t > 0),
                   any(p < 1.0 for p, t in zip(top_ps, temps) if t > 0), generators)


def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None) -> torch.Tensor:
    """Set logits outside each row's top-k and nucleus (smallest set with mass >= top_p) to -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_ks is not None:
        drop |= ranks[None, :] >= top_ks[:, None]
    if top_ps is not None:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # keep a token while the mass before it is < top_p
        drop |= mass_before >= top_ps[:, None]
    drop[:, 0] = False  # the most likely token always survives
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


class Sampler:
    """`sample(logits, tensors)` -> (B,) int64 token ids, on the logits' device."""

    def sample(self, logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        if st.all_greedy:
            return greedy
        temps = st.temperatures
        logits = logits.float() / torch.where(temps > 0, temps, 1.0)[:, None]
        if st.any_top_k or st.any_top_p:
            logits = apply_top_k_top_p(logits, st.top_ks if st.any_top_k else None,
                                       st.top_ps if st.any_top_p else None)
        noise = torch.empty_like(logits).exponential_()
        for i, gen in enumerate(st.generators):
            if gen is not None:  # seeded request: its own stream of Exp(1) draws
                noise[i].exponential_(generator=gen)
        # argmax(p_i / E_i) = argmax(logit_i - log E_i): softmax's normaliser is the same for every i of a
        # row, so it is skipped (two fewer passes over a (batch, vocab) fp32 tensor).
        sampled = logits.sub_(noise.log_()).argmax(dim=-1)
        return torch.where(temps > 0, sampled, greedy)
