"""`SpeculativeConfig`: vLLM's `speculative_config` dict, checked once before anything is built.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5, "prompt_lookup_min": 2}
    {"method": "draft_model", "num_speculative_tokens": 4, "model": "path/to/small-checkpoint"}
    {"method": "medusa" | "eagle", "num_speculative_tokens": 4, "model": "path/to/draft"}

`prompt_lookup_max` / `prompt_lookup_min` default as vLLM's do: both 5 when neither is given, else the
one given for both. EAGLE-2's tree knobs take SGLang's names: `num_steps` (the draft's depth),
`eagle_topk` (branches per node) and `num_draft_tokens` (tokens verified per step); the engine verifies
chains, so they must describe one (num_steps = num_speculative_tokens, eagle_topk = 1,
num_draft_tokens = num_steps + 1) — a tree is refused by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nano_flashattn.registry import Registry
from shared.checkpoint import read_json
from shared.config import ModelConfig

METHODS = ("ngram", "draft_model", "medusa", "eagle")
# nano_specdec's performance layers (nano_specdec/layers), applied to the engine once its proposer exists
REGISTRY = Registry("nano_specdec", points=("proposer",), modules=("draft_chain",))


def apply_layers(point: str, target: Any) -> list[str]:
    """Every layer hook at `point` that applies to `target`, in order; the names of their modules."""
    names = []
    for hook in REGISTRY.active(point, target):
        hook(target)
        names.append(hook.__module__.rpartition(".")[2])
    return names


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"speculative_config: {name} must be an int >= 1, got {value!r}")


@dataclass
class SpeculativeConfig:
    """method: "ngram" (prompt lookup), "draft_model", "medusa" or "eagle"; num_speculative_tokens: k,
    the drafts verified per step; model: the draft checkpoint (every method but ngram);
    prompt_lookup_max / _min: the n-gram lengths tried, longest first (ngram); num_steps, eagle_topk,
    num_draft_tokens: EAGLE-2's tree (eagle; module docstring); disable_by_batch_size: vLLM's, a step
    with more decoding sequences than this runs without drafts (None: never)."""

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    num_steps: int | None = None
    eagle_topk: int | None = None
    num_draft_tokens: int | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: unknown method {self.method!r}; "
                             f"valid: {list(METHODS)}")
        _positive("num_speculative_tokens", self.num_speculative_tokens)
        if self.disable_by_batch_size is not None:
            _positive("disable_by_batch_size", self.disable_by_batch_size)
        if self.method != "ngram" and not isinstance(self.model, str):
            raise ValueError(f"speculative_config: method {self.method!r} needs 'model', the "
                             f"draft's checkpoint directory, got {self.model!r}")
        self._check_tree()
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

    def _check_tree(self) -> None:
        knobs = {n: getattr(self, n) for n in ("num_steps", "eagle_topk", "num_draft_tokens")
                 if getattr(self, n) is not None}
        if knobs and self.method != "eagle":
            raise ValueError(f"speculative_config: {sorted(knobs)} are EAGLE-2's tree knobs, for "
                             f"method 'eagle', not {self.method!r}")
        for name, value in knobs.items():
            _positive(name, value)
        k = self.num_speculative_tokens
        steps = knobs.get("num_steps", k)
        if steps != k:
            raise ValueError(f"speculative_config: num_steps ({steps}) is the draft's depth and must "
                             f"equal num_speculative_tokens ({k})")
        if knobs.get("eagle_topk", 1) != 1 or knobs.get("num_draft_tokens", k + 1) != k + 1:
            tree = {n: v for n, v in knobs.items() if n != "num_steps"}
            raise ValueError(f"speculative_config: {tree} asks for EAGLE-2's draft tree, which the "
                             "engine cannot verify yet (no tree attention): a chain is eagle_topk=1, "
                             f"num_draft_tokens={k + 1} (num_steps + 1)")

    def check_draft(self, draft: ModelConfig, target: ModelConfig, target_name: str) -> None:
        """The draft `model` fits the target: the same vocabulary, and a draft of this method's kind
        (config.json's `speculative_method`, which `nano_specdec.train` writes for Medusa heads and
        EAGLE layers; a plain model is a draft_model) reading hidden states of the target's size."""
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config: the draft {self.model!r} has a vocabulary of "
                             f"{draft.vocab_size} tokens, the target {target_name!r} "
                             f"{target.vocab_size}: a draft must share the target's vocabulary")
        path = Path(str(self.model)) / "config.json"
        kind = read_json(path).get("speculative_method", "draft_model") if path.is_file() \
            else "draft_model"
        if kind != self.method:
            raise ValueError(f"speculative_config: {self.model!r} is a draft for method {kind!r} "
                             f"(config.json's speculative_method), not {self.method!r}")
        if kind != "draft_model" and draft.hidden_size != target.hidden_size:
            raise ValueError(f"speculative_config: the {kind} draft {self.model!r} reads hidden "
                             f"states of size {draft.hidden_size}, the target's are "
                             f"{target.hidden_size}")

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
