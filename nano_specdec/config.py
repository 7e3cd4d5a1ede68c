"""`SpeculativeConfig`: vLLM's `speculative_config` dict, checked once before anything is built.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5, "prompt_lookup_min": 2}
    {"method": "draft_model", "num_speculative_tokens": 4, "model": "path/to/small-checkpoint"}

`prompt_lookup_max` / `prompt_lookup_min` default as vLLM's do: both 5 when neither is given, else the
one given for both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"speculative_config: {name} must be an int >= 1, got {value!r}")


@dataclass
class SpeculativeConfig:
    """method: "ngram" (prompt lookup) or "draft_model"; num_speculative_tokens: k, the drafts verified
    per step; model: the draft checkpoint (draft_model); prompt_lookup_max / _min: the n-gram lengths
    tried, longest first (ngram)."""

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: unknown method {self.method!r}; "
                             f"valid: {list(METHODS)}")
        _positive("num_speculative_tokens", self.num_speculative_tokens)
        if self.method == "draft_model" and not isinstance(self.model, str):
            raise ValueError("speculative_config: method 'draft_model' needs 'model', the draft's "
                             f"checkpoint directory or preset name, got {self.model!r}")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config: 'model' is for method 'draft_model'; "
                                 "prompt lookup ('ngram') has no draft model")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            self.prompt_lookup_min = lo = (hi if lo is None else lo) or 5
            self.prompt_lookup_max = hi = (lo if hi is None else hi)
            _positive("prompt_lookup_min", lo)
            _positive("prompt_lookup_max", hi)
            if hi < lo:
                raise ValueError(f"speculative_config: prompt_lookup_max ({hi}) must be >= "
                                 f"prompt_lookup_min ({lo})")

    @classmethod
    def of(cls, value: SpeculativeConfig | Mapping[str, Any]) -> SpeculativeConfig:
        """A SpeculativeConfig from vLLM's dict; TypeError naming unknown or missing keys."""
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"speculative_config must be a dict, got {type(value).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise TypeError(f"speculative_config: unknown key(s) {unknown}; valid: {sorted(names)}")
        missing = [k for k in ("method", "num_speculative_tokens") if k not in value]
        if missing:
            raise TypeError(f"speculative_config: missing key(s) {missing}")
        return cls(**value)
