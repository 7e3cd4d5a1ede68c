"""Medusa's draft heads (Cai et al. 2024, arXiv 2401.10774, §2.1.1) and the proposer that reads them.

Head k (k = 1 .. K) predicts the token k + 1 positions past the target's last hidden state h_t, from
h_t alone: p_t^(k) = softmax(W_2^(k) · (SiLU(W_1^(k) · h_t + b_1^(k)) + h_t)) — a residual block on
the target's last hidden state and an LM head. W_1 starts at zero, so an untrained head is the identity
before its LM head; W_2 starts as the target's LM head (§2.1.1), or is the target's own, frozen
(`share_lm_head`). Medusa-1 (§2.2.1) trains the heads with the target frozen; `nano_specdec.train`
does that on the target's own generations.

`MedusaProposer` proposes a chain: the top-1 token of each head, from the hidden state of the row that
produced the sequence's last token (its feature, handed over by the verifying runner each step). The
chain is deterministic, so it is verified with one-hot draft probabilities at any temperature (exact).
Medusa's static tree of top-k candidates needs tree attention in the verify step, not built yet.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch
import torch.nn.functional as F
from torch import nn

from nano_vllm.sequence import Sequence
from shared.checkpoint import load_state_dict, read_json
from shared.model import CausalLM


class ResBlock(nn.Module):
    """h + SiLU(W h + b), W zero-initialised (Medusa's ResBlock)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.silu(self.linear(h))


class MedusaHeads(nn.Module):
    """K heads of `num_layers` ResBlocks each, then an LM head of their own (initialised as the
    target's) or the target's own. Parameter names are Medusa's (`medusa_head.{k}.{layer}...`)."""

    def __init__(self, target: CausalLM, num_heads: int, num_layers: int = 1,
                 share_lm_head: bool = False):
        super().__init__()
        h, v = target.config.hidden_size, target.config.vocab_size
        self.num_heads, self.num_layers, self.share_lm_head = num_heads, num_layers, share_lm_head
        self.target = (target,)  # frozen and not a parameter of the heads (a tuple hides it)
        heads = []
        for _ in range(num_heads):
            blocks: list[nn.Module] = [ResBlock(h) for _ in range(num_layers)]
            if not share_lm_head:
                blocks.append(nn.Linear(h, v, bias=False))
                blocks[-1].weight.data.copy_(target.lm_head.weight.data)
            heads.append(nn.Sequential(*blocks))
        self.medusa_head = nn.ModuleList(heads)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., K, V] of the K heads on hidden states [..., H]."""
        out = [head(hidden) for head in self.medusa_head]
        if self.share_lm_head:
            out = [self.target[0].compute_logits(x) for x in out]
        return torch.stack(out, -2)

    @classmethod
    def load(cls, path: str, target: CausalLM) -> MedusaHeads:
        """Heads saved by `nano_specdec.train method=medusa` (config.json's medusa_* keys)."""
        cfg = read_json(f"{path}/config.json")
        heads = cls(target, cfg["medusa_num_heads"], cfg["medusa_num_layers"],
                    cfg.get("share_lm_head", False))
        heads.load_state_dict(load_state_dict(path))
        w = target.lm_head.weight
        return heads.to(w.device, w.dtype).eval()


class MedusaProposer:
    """Top-1 of each head on the feature of each sequence's last token (module docstring)."""

    def __init__(self, path: str, target: CausalLM, k: int):
        self.heads = MedusaHeads.load(path, target)
        if k > self.heads.num_heads:
            raise ValueError(f"speculative_config: num_speculative_tokens ({k}) exceeds the "
                             f"{self.heads.num_heads} Medusa heads of {path!r}")
        self.last: dict[int, tuple[int, torch.Tensor]] = {}  # seq_id -> (position, its feature)

    def observe(self, seq: Sequence, start: int, hidden: torch.Tensor) -> None:
        """The target's hidden states of `seq`'s tokens start, start + 1, ... (this step's rows)."""
        self.last[seq.seq_id] = (start + len(hidden) - 1, hidden[-1])

    @torch.inference_mode()
    def propose(self, seqs: Seq[Sequence], ks: Seq[int]) -> tuple[list[list[int]], list[None]]:
        # the feature that produced the last token: at position num_tokens - 2
        ready = [i for i, s in enumerate(seqs)
                 if self.last.get(s.seq_id, (-1,))[0] == s.num_tokens - 2]
        drafts: list[list[int]] = [[] for _ in seqs]
        if ready:
            top = self.heads(torch.stack([self.last[seqs[i].seq_id][1] for i in ready])).argmax(-1)
            for i, row in zip(ready, top.tolist()):
                drafts[i] = row[: ks[i]]
        return drafts, [None] * len(seqs)

    def release(self, seq: Sequence) -> None:
        self.last.pop(seq.seq_id, None)
