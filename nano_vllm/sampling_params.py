"""`SamplingParams`: vLLM's per-request decoding knobs, validated on construction.

The paper (vLLM, arXiv 2309.06180, §4.3) treats decoding as "sample one token per step from the model's
next-token distribution"; these parameters say how that distribution is shaped before sampling.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """How to pick each next token of one request (vLLM's names and defaults).

    n: how many samples of the prompt to generate (parallel sampling, vLLM §4.4): `LLM.generate` returns
        them as the `outputs` of one RequestOutput; they share the prompt's KV blocks through the prefix
        cache, and sample j draws from seed + j when a seed is given (`child`).
    temperature: 0 is greedy (argmax); otherwise logits are divided by it before softmax.
    top_p: nucleus sampling, keep the smallest set of tokens whose probability mass reaches top_p (1 = off).
    top_k: keep the k most likely tokens (-1 or 0 = off).
    max_tokens: how many tokens to generate at most.
    ignore_eos: keep generating past the end-of-sequence token (benchmarks).
    stop_token_ids: extra token ids that end the request (the stop token stays in `token_ids`, like EOS).
    stop: strings that end the request when they appear in the output text (matched on the detokenized
        text, so across token boundaries); the text is cut before the string and the output's
        `stop_reason` is the string (vLLM's rule).
    include_stop_str_in_output: also render the stop string, or the text of the stop token (EOS or one of
        stop_token_ids), that ended the request; by default it is left out of the text, as vLLM does.
    logprobs: return, for each output token, its log-probability and those of the `logprobs` most likely
        tokens (0: the sampled token's alone); the model's raw log-softmax, before temperature and top-k/p
        (vLLM's default `logprobs_mode`).
    prompt_logprobs: the same for every prompt token (the first has none). Such a request does not read
        the prefix cache: a cached token's logits are never computed.
    seed: per-request random seed, any int (folded into 64 bits, `sampler.seed64`); the same seed and
        prompt give the same tokens whatever else is batched.
    skip_special_tokens: leave special tokens (`<|endoftext|>`, `<|im_end|>`, ...) out of the text.

    Bad values raise ValueError naming the field.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = field(default=None)
    seed: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1
    stop: list[str] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or a positive int, got {self.top_k!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids
            ):
                raise ValueError(f"stop_token_ids must be a list of token ids >= 0, got {self.stop_token_ids!r}")
            self.stop_token_ids = list(self.stop_token_ids)
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        for name in ("skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
                raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
            if any(s == "" for s in self.stop):
                raise ValueError("stop must not contain an empty string (it would match everywhere)")
            self.stop = list(self.stop) or None
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise ValueError(f"{name} must be None or an int >= 0, got {value!r}")
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        if self.top_k == 0:
            self.top_k = -1  # OpenAI-style clients send 0 for "off"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def child(self, j: int) -> SamplingParams:
        """The parameters of sample j of n (vLLM's parallel sampling): n = 1, seed + j when seeded, and
        the prompt's log-probabilities asked of sample 0 only."""
        seed = None if self.seed is None else self.seed + j
        return dataclasses.replace(self, n=1, seed=seed,
                                   prompt_logprobs=self.prompt_logprobs if j == 0 else None)
