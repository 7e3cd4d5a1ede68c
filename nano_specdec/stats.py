"""vLLM's speculative-decoding counters, which nano_specdec's scheduler keeps and `/metrics` exports
(`vllm:spec_decode_num_draft_tokens`, `..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos`), and
τ (Leviathan §3.1's expected tokens per target forward, measured)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """vLLM's spec_decode counters: drafted and accepted tokens, accepted count by draft position."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verifications: int = 0  # sequence-steps that verified drafts
    accepted_by_position: list[int] = field(default_factory=list)

    def add(self, num_drafts: int, num_accepted: int) -> None:
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.num_verifications += 1
        grow = num_drafts - len(self.accepted_by_position)
        self.accepted_by_position += [0] * max(grow, 0)
        for i in range(num_accepted):
            self.accepted_by_position[i] += 1

    @property
    def mean_tokens_per_verification(self) -> float:
        """τ: tokens emitted per verifying forward of a sequence (accepted drafts + 1)."""
        return 1 + self.num_accepted_tokens / max(self.num_verifications, 1)
