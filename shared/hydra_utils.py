"""Hydra configs → the typed dataclasses the trainers use (TrainConfig, ModelConfig, any package's own).

Every trainer's config has a `model` group whose files name a preset (or checkpoint) plus overrides,
e.g. `nano_zero/configs/model/tiny.yaml`:

    preset: tiny
    num_hidden_layers: 2

and a `train` node with TrainConfig's fields. Unknown keys are errors, not silently ignored.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import torch
from omegaconf import DictConfig, OmegaConf

from shared.config import ModelConfig, resolve_model_config

T = TypeVar("T")


def _as_dict(node: DictConfig | dict[str, Any] | None) -> dict[str, Any]:
    if node is None:
        return {}
    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=True)  # type: ignore[return-value]
    return dict(node)


def to_dataclass(cls: type[T], node: DictConfig | dict[str, Any] | None, **overrides: Any) -> T:
    """`cls(**node, **overrides)`, with a ValueError naming any key `cls` does not have."""
    values = {**_as_dict(node), **overrides}
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; valid: {sorted(names)}")
    return cls(**values)


def model_config_from(node: DictConfig | dict[str, Any] | str) -> ModelConfig:
    """A `model` node: `preset` (a preset name or HF checkpoint directory) plus ModelConfig overrides."""
    if isinstance(node, str):
        return resolve_model_config(node)
    values = _as_dict(node)
    preset = values.pop("preset", None)
    if preset is None:
        return to_dataclass(ModelConfig, values)
    base = dataclasses.asdict(resolve_model_config(preset))
    base.pop("extra")
    return to_dataclass(ModelConfig, base, **values)


def hydra_run_dir(default: str = ".") -> str:
    """The current Hydra run's output directory (where its config and our metrics/checkpoints go).

    Under torchrun each rank's Hydra may stamp a different `${now:}` directory, so with a process group
    every rank returns rank 0's (one run, one directory)."""
    from hydra.core.hydra_config import HydraConfig

    out = HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else default
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        box = [out]
        torch.distributed.broadcast_object_list(box, src=0)
        out = box[0]
    return out


def peak_flops_from(cfg: DictConfig | dict[str, Any], device: torch.device) -> float | None:
    """The MFU denominator: `peak_tflops` from the config if set, else the bf16 matmul rate measured on
    this CUDA device (shared.bench), else None (no MFU on CPU)."""
    peak = _as_dict(cfg).get("peak_tflops")
    if peak:
        return float(peak) * 1e12
    if device.type == "cuda":
        from shared.bench import measure_matmul_flops

        return measure_matmul_flops(device)
    return None


__all__ = ["hydra_run_dir", "model_config_from", "peak_flops_from", "to_dataclass"]
