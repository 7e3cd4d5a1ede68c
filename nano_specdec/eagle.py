"""EAGLE's draft (Li et al. 2024, arXiv 2401.15077, §4) and the proposer that runs it in the engine.

EAGLE drafts at the feature level: the target's feature f_j (its last hidden state at position j, the
input of its LM head) and the embedding of the token that followed, x_{j+1}, go through an FC layer
(2H -> H) and one decoder layer to predict the next feature f̂_{j+1}; the target's own LM head (frozen)
turns it into the distribution of x_{j+2} (§4.1). Drafting is autoregressive on the draft's own
outputs: (f̂_{j+1}, x̂_{j+2}) -> f̂_{j+2}, and so on. The embedding and the LM head are the target's.

In the engine the draft layer runs through nano_vllm's `ModelRunner` on its own paged KV cache, as
`DraftModelProposer`'s model does: position j of the draft's sequence holds the pair (f_j, x_{j+1}).
Its features go in, and its f̂ come out, through two fixed buffers, so the runner's CUDA graphs replay
the draft's steps like a model's.
The target's features arrive from the verifying runner each step (`observe`: every row it computed,
only the accepted ones of a verification). A proposal for a sequence of n tokens computes the pairs
of the features received since the last one (up to f_{n-2}, x_{n-1}) in its first forward, then k − 1
pairs of its own drafts; only the pairs of real features stay in the draft's KV cache. A sequence whose
prompt came from the prefix cache has no features for the cached tokens: its pairs start at the first
token the target computed (RoPE is relative, so positions counted from there change nothing else).

The chain is the draft's top-1 for greedy requests and a draw from its distribution after the request's
temperature / top-k / top-p otherwise, recorded as q for the exact rule (Leviathan Algorithm 1).
EAGLE-2's dynamic tree (expand the top-k by cumulative probability, rerank) needs tree attention in the
verify step, not built yet: `eagle_topk` > 1 is refused by the config.
"""

from __future__ import annotations

import torch
from torch import nn

from nano_specdec.proposers import DraftModelProposer, DraftSeq, release_blocks
from nano_vllm.config import EngineConfig
from nano_vllm.model_runner import ModelRunner
from nano_vllm.sequence import Sequence
from shared.checkpoint import load_state_dict
from shared.config import ModelConfig
from shared.model import CausalLM, DecoderLayer, rope_inv_freq


class EagleDraft(nn.Module):
    """fc(concat(f_j, embed(x_{j+1}))) -> one shared.model DecoderLayer -> f̂_{j+1}; logits through the
    target's LM head. `model` is itself, so nano_vllm's `ModelRunner` runs it as it runs a CausalLM;
    the features of the rows it computes come in the first rows of `features` ([rows, H], the packed
    batch's order) and f̂ of the rows it computes logits of go to the first rows of `out`: the
    proposer's fixed buffers, which a captured CUDA graph reads and writes as an eager step does."""

    def __init__(self, cfg: ModelConfig, target: CausalLM):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, 0)])
        self.target = (target,)  # frozen and not a parameter of the draft (a tuple hides it)
        self.features: torch.Tensor | None = None
        self.out: torch.Tensor | None = None

    @property
    def model(self) -> EagleDraft:
        return self

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: object = None,
                features: torch.Tensor | None = None) -> torch.Tensor:
        """f̂ for every pair (features[i], input_ids[i]); input_ids [B, S], features [B, S, H]."""
        # the engine's steps: their rows of the buffer
        f = self.features[: input_ids.numel()] if features is None else features
        f = f.reshape(*input_ids.shape, -1)
        x = self.fc(torch.cat([f, self.target[0].model.embed_tokens(input_ids)], -1))
        freqs = positions.float()[..., None] * rope_inv_freq(self.config, positions.device)
        h, residual = self.layers[0](x, None, freqs.cos(), freqs.sin(), ctx)
        return h + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.out is not None:
            self.out[: len(hidden)] = hidden
        return self.target[0].compute_logits(hidden)

    def set_attention(self, fn: object) -> None:
        self.layers[0].self_attn.attn_fn = fn


class LoadedRunner(ModelRunner):
    """nano_vllm's runner over a model built here rather than loaded from `config.model`."""

    def __init__(self, model: nn.Module, *args: object):
        self.loaded = model
        super().__init__(*args)

    def load_model(self) -> nn.Module:
        return self.loaded


class EagleSeq(DraftSeq):
    """A sequence's draft state: pairs from target position `base`, `real` of them with K/V kept, and
    the target features not yet turned into pairs (`pending`)."""

    def __init__(self, seq: Sequence, base: int, hidden_size: int, like: torch.Tensor):
        super().__init__(seq)
        self.base, self.real = base, 0
        self.pending = like.new_empty(0, hidden_size)
        self.inputs = self.pending  # the features of the rows the next draft forward computes


class EagleProposer(DraftModelProposer):
    """EAGLE's draft layer on its own paged KV cache (module docstring); the loop and the draws are
    `DraftModelProposer`'s."""

    def __init__(self, config: EngineConfig, path: str, draft_config: ModelConfig,
                 num_blocks: int, max_model_len: int, target: CausalLM):
        w = target.lm_head.weight
        draft = EagleDraft(draft_config, target)
        draft.load_state_dict(load_state_dict(path))
        self.draft = draft.to(w.device, w.dtype).eval()
        # rows: the most a graph computes (max_num_batched_tokens >= max_num_seqs and mixed sizes)
        self.buf, self.draft.out = w.new_zeros(2, config.max_num_batched_tokens, w.shape[1])
        self.draft.features = self.buf
        super().__init__(config, path, draft_config, num_blocks, max_model_len)

    def make_runner(self, cfg: EngineConfig, draft_config: ModelConfig,
                    max_model_len: int) -> ModelRunner:
        # CUDA graphs (they read `features` from its fixed buffer) and the per-module layers; not the
        # fused decoder layer, which runs a model's own layers, nor the overlap and fused sampling
        cfg = cfg.replace(fused_decode=False, fused_sampling=False, async_scheduling=False)
        return LoadedRunner(self.draft, cfg, draft_config, max_model_len)

    def observe(self, seq: Sequence, start: int, hidden: torch.Tensor) -> None:
        """The target's features of `seq`'s tokens start, start + 1, ... (this step's rows)."""
        d = self.seqs.get(seq.seq_id)
        if d is None or d.base + d.real + len(d.pending) != start:  # new, or recomputed
            self.release(seq)
            d = self.seqs[seq.seq_id] = EagleSeq(seq, start, hidden.shape[-1], hidden)
        d.pending = torch.cat([d.pending, hidden])

    def _sync(self, seq: Sequence) -> EagleSeq | None:
        """Roll back to the real pairs; the pairs up to (f_{n-2}, x_{n-1}) to compute; None without
        the features for them or without room in the draft's KV pool."""
        d = self.seqs.get(seq.seq_id)
        if d is None or not len(d.pending) or \
                d.base + d.real + len(d.pending) != seq.num_tokens - 1:
            return None
        d.num_computed_tokens = d.real
        release_blocks(self.block_manager, d, d.real)
        d.token_ids = seq.token_ids[d.base + 1 :]  # pair j holds x_{base + j + 1}
        d.drafts, d.probs = [], []
        if not self.block_manager.allocate_slots(d, d.num_tokens - d.real):
            return None
        d.inputs, d.pending, d.real = d.pending, d.pending[:0], d.num_tokens
        return d

    def _forward(self, batch: list[EagleSeq]) -> torch.Tensor:
        x = torch.cat([d.inputs for d in batch])
        # a catch-up over a whole prompt can pass the buffer: no graph is that large, it runs eagerly
        self.draft.features = self.buf if len(x) <= len(self.buf) else x
        self.draft.features[: len(x)] = x  # (onto itself past the buffer)
        logits = super()._forward(batch)
        out = self.draft.out[: len(batch)].clone()  # the buffer is the next step's
        for j, d in enumerate(batch):  # the next row's feature is this one's prediction
            d.inputs = out[j : j + 1]
        return logits
