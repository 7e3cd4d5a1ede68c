"""Calibration: a few hundred windows of text, run through the model, and what the quantizers measure on them.

Both papers calibrate offline on a small sample of the Pile (AWQ: 128 sequences of 512 tokens, as
AutoAWQ's defaults; SmoothQuant: 512 sentences). We draw ours from the training split of the project's corpora
(`shared.data`: the stdlib source by default), so calibration needs no download and never sees the
held-out modules that perplexity is measured on.

`input_stats` records, for the input of every `nn.Linear` in the decoder layers, two per-input-channel
statistics over all calibration tokens: max|X_j| (SmoothQuant Eq. 4's numerator) and mean|X_j| (AWQ's
s_X, §3.2). Their ratio across channels (max / median of max|X_j|) is the outlier statistic of
SmoothQuant §3 (Fig. 4: "outliers persist in fixed channels").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from shared.data import TokenBatches
from shared.model import CausalLM


def calibration_samples(n_samples: int = 128, seq_len: int = 512, corpus: str = "stdlib",
                        seed: int = 0) -> torch.Tensor:
    """(n_samples, seq_len) int64 token windows drawn uniformly from the corpus' training split."""
    return TokenBatches.from_corpus("train", batch_size=n_samples, seq_len=seq_len, seed=seed,
                                    corpus=corpus).next_batch()[0]


@dataclass
class ChannelStats:
    """Per-input-channel statistics of one Linear's input over every calibration token (fp32, shape (K,))."""

    absmax: torch.Tensor
    absmean: torch.Tensor
    tokens: int = 0

    def update(self, x: torch.Tensor) -> None:
        a = x.detach().reshape(-1, x.shape[-1]).abs().float()
        n = a.shape[0]
        self.absmax = torch.maximum(self.absmax, a.amax(0))
        self.absmean = (self.absmean * self.tokens + a.sum(0)) / (self.tokens + n)
        self.tokens += n

    def outlier_ratio(self) -> float:
        """max_j / median_j of max|X_j|: ~1-3 for a flat activation, 10-100+ with outlier channels."""
        return float(self.absmax.max() / self.absmax.median().clamp(min=1e-8))


def decoder_linears(model: CausalLM) -> dict[str, nn.Linear]:
    """Every nn.Linear of the decoder layers by its HF name (`model.layers.0.self_attn.q_proj`); the
    embeddings and the LM head stay in high precision, as in both papers."""
    return {f"model.layers.{i}.{name}": m for i, layer in enumerate(model.model.layers)
            for name, m in layer.named_modules() if isinstance(m, nn.Linear)}


@torch.no_grad()
def input_stats(model: CausalLM, samples: torch.Tensor, batch_size: int = 8,
                progress: bool = False) -> dict[str, ChannelStats]:
    """Run `samples` through `model` in batches; ChannelStats of the input of every decoder Linear."""
    stats: dict[str, ChannelStats] = {}
    dev = next(model.parameters()).device

    def hook(name: str):
        def record(module: nn.Linear, args: tuple) -> None:
            if name not in stats:
                zeros = torch.zeros(module.in_features, device=dev)
                stats[name] = ChannelStats(zeros, zeros.clone())
            stats[name].update(args[0])
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in decoder_linears(model).items()]
    try:
        for batch in tqdm(samples.split(batch_size), desc="calibrate", disable=not progress):
            model.model(batch.to(dev))  # the decoder stack only: no LM head logits
    finally:
        for h in handles:
            h.remove()
    return stats
