"""`SGLSequence`: nano_vllm's `Sequence` plus the per-request state of SGLang's primitives (arXiv 2312.07104).

* `constraint` — constrained decoding (§4): the request's position in its regex FSM, advanced by the
  scheduler after each token and read by the model runner for the token mask.
* `score_from` / `prompt_logprobs` — `select` (§2) scores its choices by the log-probabilities of prompt
  tokens [score_from, len): the model runner fills `prompt_logprobs`, and the block manager never serves
  those tokens from the cache (their logits must be computed).

The engine builds every request as one (`SGLEngine.sequence_cls`), so nothing is attached at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nano_vllm.sampling_params import SamplingParams
from nano_vllm.sequence import Sequence

if TYPE_CHECKING:
    from nano_sglang.constrained import Constraint


class SGLSequence(Sequence):
    """A request of the SGLang runtime: nano_vllm's `Sequence` plus `constraint`, `score_from` and
    `prompt_logprobs` (module docstring). Raises ValueError for a `score_from` outside [1, prompt length)."""

    def __init__(self, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
                 request_id: str | None = None, arrival_time: float | None = None, *,
                 constraint: Constraint | None = None, score_from: int | None = None):
        super().__init__(prompt_token_ids, sampling_params, request_id, arrival_time)
        if score_from is not None and not 1 <= score_from < self.num_prompt_tokens:
            raise ValueError(f"score_from must be in [1, {self.num_prompt_tokens}), "
                             f"got {score_from}")
        self.constraint = constraint
        self.score_from = score_from
        self.prompt_logprobs: list[float] = []  # of prompt tokens score_from, score_from + 1, ...

    @property
    def num_cacheable_tokens(self) -> int:
        """Leading tokens that may come from the prefix cache: all, unless the request scores its prompt
        from `score_from`, whose logits come from position score_from - 1 on."""
        return self.num_tokens if self.score_from is None else self.score_from - 1
