"""Model configuration: one dataclass with Hugging Face field names, HF `config.json` import/export, presets.

The field names are exactly the ones in a Llama / Qwen2 / Qwen3 `config.json`, so a reader who knows
`transformers` knows this file, and `ModelConfig.from_hf` is mostly a filter over the HF dictionary.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

# HF architecture name -> model_type. The three families differ only in two switches:
# Qwen2 adds a bias to q/k/v projections, Qwen3 adds RMSNorm on q and k per head (and drops the bias).
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
MODEL_TYPES = {v: k for k, v in ARCHITECTURES.items()}


@dataclass
class ModelConfig:
    """A decoder-only Transformer (Llama / Qwen2 / Qwen3 family), HF field names.

    `head_dim` defaults to hidden_size // num_attention_heads (Llama's convention); Qwen3 sets it
    explicitly (e.g. 0.6B: hidden 1024, 16 heads, head_dim 128).
    `rope_scaling` is None or HF's dict; only the "llama3" frequency-dependent scaling is implemented.
    """

    vocab_size: int = 4096
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    initializer_range: float = 0.02
    extra: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                    f"({self.num_attention_heads}); set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) (grouped-query attention)"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("default", "llama3"):
                raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, llama3)")
            if kind == "default":
                self.rope_scaling = None

    # ------------------------------------------------------------------ derived names
    @property
    def model_type(self) -> str:
        """The HF family this configuration belongs to (decides the saved `config.json`)."""
        if self.qk_norm:
            return "qwen3"
        return "qwen2" if self.attention_bias else "llama"

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ HF import / export
    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | dict[str, Any]) -> ModelConfig:
        """Build from a HF `config.json` (a checkpoint directory, the file, or its parsed dict).

        Accepts Llama, Qwen2 and Qwen3 configs, in both the transformers-4 spelling (`rope_theta`,
        `rope_scaling`) and the transformers-5 one (`rope_parameters`).
        """
        if isinstance(path_or_dict, dict):
            d = dict(path_or_dict)
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"no config.json at {path!r}")
            with open(path) as f:
                try:
                    d = json.load(f)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path!r} is not valid JSON ({e}): a corrupt or truncated config.json") from e
        model_type = d.get("model_type")
        archs = d.get("architectures") or []
        if model_type is None and archs:
            model_type = ARCHITECTURES.get(archs[0])
        if model_type not in MODEL_TYPES:
            raise ValueError(
                f"unknown architecture (model_type={d.get('model_type')!r}, architectures={archs!r}); "
                f"supported: {sorted(ARCHITECTURES)}"
            )
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported (only silu / SwiGLU)")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        if d.get("use_sliding_window"):
            raise ValueError("use_sliding_window=True is not supported")
        rope = d.get("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        rope_scaling = d.get("rope_scaling")
        if rope_scaling is None and rope.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "qk_norm", "rope_theta", "rope_scaling"}
        kwargs = {k: d[k] for k in names if k in d and d[k] is not None}
        if model_type == "qwen2":
            kwargs["attention_bias"] = True  # Qwen2 always has q/k/v bias; its config does not say so
        elif kwargs.get("attention_bias"):
            # Llama/Qwen3's flag also puts a bias on o_proj, which the one model does not have.
            raise ValueError(f"attention_bias=True is not supported for model_type {model_type!r}")
        return cls(**kwargs, rope_theta=float(rope_theta), rope_scaling=rope_scaling,
                   qk_norm=(model_type == "qwen3"))

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` dictionary `transformers` reads back (AutoConfig / AutoModelForCausalLM)."""
        d: dict[str, Any] = {
            "architectures": [MODEL_TYPES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "float32",
        }
        if self.model_type == "qwen3" and self.attention_bias:
            raise ValueError("qk_norm together with attention_bias has no HF architecture to save as")
        if self.model_type != "qwen2":
            d["attention_bias"] = False
        if self.model_type == "llama":
            d["mlp_bias"] = False
        if self.model_type == "qwen2":
            d["use_sliding_window"] = False
        return d

    @classmethod
    def from_name(cls, name: str) -> ModelConfig:
        """A named preset (see PRESETS)."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name])


PRESETS: dict[str, ModelConfig] = {
    # Small enough for CPU tests and a few minutes of CPU training; vocab matches shared.tokenizer.
    "tiny": ModelConfig(
        vocab_size=4096, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=2048, qk_norm=True,
        eos_token_id=4095,
    ),
    # Llama shape at ~107M parameters, sized for the stdlib source corpus (~10M tokens, shared.data):
    # nano_quant's quantization-quality model, trained in a few minutes on one GPU (nano_quant/README.md).
    "llama-100m": ModelConfig(
        vocab_size=4096, hidden_size=768, intermediate_size=2048, num_hidden_layers=16,
        num_attention_heads=12, num_key_value_heads=4, head_dim=64, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=2048,
        eos_token_id=4095,
    ),
    "qwen3-0.6b": ModelConfig(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=40960, qk_norm=True,
        bos_token_id=151643, eos_token_id=151645,
    ),
    "llama2-7b": ModelConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, head_dim=128, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2,
    ),
    "llama3-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=8192,
        bos_token_id=128000, eos_token_id=128001,
    ),
}


def resolve_model_config(model: str | dict[str, Any] | ModelConfig) -> ModelConfig:
    """A preset name, a checkpoint directory / config.json path, a dict of fields, or a ModelConfig."""
    if isinstance(model, ModelConfig):
        return model
    if isinstance(model, dict):
        return ModelConfig(**model)
    if isinstance(model, str) and model in PRESETS:
        return ModelConfig.from_name(model)
    if isinstance(model, (str, os.PathLike)) and os.path.exists(model):
        return ModelConfig.from_hf(model)
    raise ValueError(f"model {model!r} is neither a preset ({sorted(PRESETS)}) nor an existing path")
