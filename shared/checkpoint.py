"""Hugging Face-format checkpoints: a directory with `config.json` and `*.safetensors`.

Because shared.model uses HF's parameter names, loading is "read every tensor, check its name and shape,
assign it"; saving is the reverse plus a `config.json` that `transformers` understands. Large models are
split into shards with a `model.safetensors.index.json` (HF's layout), so what nano_megatron and nano_zero
save loads in `transformers`, in nano_vllm, and back here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shared.config import ModelConfig
from shared.model import CausalLM

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Tensors some HF checkpoints carry that are recomputed here, never learned.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _checkpoint_dir(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(p)!r} does not exist")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"checkpoint directory {str(p)!r} has no config.json")
    return p


def _safetensors_files(p: Path) -> list[Path]:
    if (p / INDEX_NAME).is_file():
        with open(p / INDEX_NAME) as f:
            weight_map = json.load(f)["weight_map"]
        files = [p / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"checkpoint directory {str(p)!r} has no *.safetensors files")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint shard {str(f)!r} named in {INDEX_NAME} is missing")
    return files


def load_state_dict(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, by name (sharded or not)."""
    p = _checkpoint_dir(path)
    out: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(p):
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
    return out


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> CausalLM:
    """Build shared.model from an HF checkpoint directory (Llama, Qwen2, Qwen3) and load its weights.

    Raises FileNotFoundError (no directory / config / weights), ValueError (unknown architecture, a
    missing or unexpected tensor, a tensor of the wrong shape), each naming the offending item.
    """
    p = _checkpoint_dir(path)
    cfg = ModelConfig.from_hf(p)
    with torch.device("meta"):
        model = CausalLM(cfg)
    expected = {name: t.shape for name, t in model.state_dict().items()}
    tied = cfg.tie_word_embeddings
    state = {k: v for k, v in load_state_dict(p).items() if not k.endswith(_IGNORED_SUFFIXES)}
    if tied:  # a tied checkpoint stores the embedding once; the head shares it
        state.pop("lm_head.weight", None)
        expected.pop("lm_head.weight")
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"checkpoint {str(p)!r} is missing tensor(s) {missing[:5]}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ValueError(f"checkpoint {str(p)!r} has unexpected tensor(s) {unexpected[:5]} "
                         f"for a {cfg.model_type} model")
    for name, shape in expected.items():
        if tuple(state[name].shape) != tuple(shape):
            raise ValueError(f"tensor {name!r} in {str(p)!r} has shape {tuple(state[name].shape)}, "
                             f"expected {tuple(shape)} from config.json")
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)  # assign: keep the loaded storage, no copy
    model.tie_weights()
    return model


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    s = size.strip().upper()
    for unit, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


def save_checkpoint(model: CausalLM | dict[str, torch.Tensor], cfg: ModelConfig, path: str | os.PathLike,
                    max_shard_size: int | str = "2GB", dtype: torch.dtype | None = None) -> Path:
    """Write `config.json` + safetensors shards (with HF's index file when there is more than one).

    `model` may be a CausalLM or a consolidated state dict (what the parallel trainers gather on rank 0).
    """
    state = model.state_dict() if isinstance(model, torch.nn.Module) else dict(model)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    limit = _parse_size(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        t = t.detach().to("cpu", dtype=dtype or t.dtype).contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    for old in p.glob("*.safetensors"):  # never leave a stale shard that a loader would pick up
        old.unlink()
    (p / INDEX_NAME).unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(p / SINGLE_NAME), metadata={"format": "pt"})
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(p / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            total += sum(t.numel() * t.element_size() for t in shard.values())
        with open(p / INDEX_NAME, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    hf = cfg.to_hf()
    first = next(iter(state.values()))
    hf["torch_dtype"] = hf["dtype"] = str(dtype or first.dtype).removeprefix("torch.")
    with open(p / "config.json", "w") as f:
        json.dump(hf, f, indent=2)
    return p
