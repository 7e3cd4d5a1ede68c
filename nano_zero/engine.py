"""ZeroEngine: shared.model under ZeroDataParallel, as a `shared.train.TrainEngine` the one loop drives.

The model is built on the meta device and materialised unit by unit inside ZeroDataParallel (§5.3), with
the same initial weights `shared.model.build_model(cfg, seed=seed)` gives one process, so a ZeRO run and
the single-process LocalEngine start, and stay, equal. The engine reports what the paper's ledgers count:
the model-state bytes (`memory_report`) and the elements each step moves (`last_step_comm`, through
`nano_zero.ledger.count_communication`). nano_zero has no performance layer of its own;
`performance_layers=False` runs the steps inside `nano_flashattn.registry.performance_layers(False)`, so
shared.model's kernels take their paper paths.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from nano_flashattn.registry import performance_layers as layers_switch
from nano_zero.ledger import MemoryReport, count_communication, memory_report
from nano_zero.zero import ZeroDataParallel
from shared.checkpoint import load_resume_file
from shared.config import ModelConfig
from shared.model import CausalLM, init_module_
from shared.train import StepResult, TrainConfig, check_seq_len, next_token_loss


def init_like_build_model(std: float) -> Callable[[nn.Module, torch.Generator], None]:
    """`shared.model.init_module_` bound to `std`: per module, in `modules()` order with one generator,
    it draws exactly the numbers `build_model` draws (the tests check)."""
    return lambda module, gen: init_module_(module, std, gen)


class ZeroEngine:
    """TrainEngine for ZeRO stage 0–3 data parallelism over `group` (default: all ranks)."""

    def __init__(self, model_config: ModelConfig, cfg: TrainConfig, stage: int, *,
                 device: torch.device | str | None = None, group: dist.ProcessGroup | None = None,
                 prefetch: bool = True, performance_layers: bool = True) -> None:
        check_seq_len(cfg, model_config)  # before any collective, on every rank alike
        if not isinstance(performance_layers, bool):
            raise TypeError(f"performance_layers must be true or false, got {performance_layers!r}")
        self.model_config, self.cfg, self.stage = model_config, cfg, stage
        self.performance_layers = performance_layers
        with torch.device("meta"):
            module = CausalLM(model_config)
        init_fn = init_like_build_model(model_config.initializer_range)
        self.model = ZeroDataParallel(
            module, stage, dtype=cfg.torch_dtype, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
            weight_decay=cfg.weight_decay, group=group, init_fn=init_fn, seed=cfg.seed,
            prefetch=prefetch, device=device)
        self.counter = count_communication(self.model)
        self.device = self.model.device
        self.dp_rank, self.dp_world_size = self.model.rank, self.model.world
        self.last_step_comm: tuple[int, int] = (0, 0)  # (elements, bytes) of the last train_step

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> StepResult:
        """Forward/backward each micro-batch (communication only on the last, except stage 3), then step."""
        with nullcontext() if self.performance_layers else layers_switch(False):
            return self._train_step(micro_batches, lr)

    def _train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> StepResult:
        start = self.counter.snapshot()
        num_tokens = sum(y.numel() for _, y in micro_batches) * self.dp_world_size
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        last = len(micro_batches) - 1
        for i, (x, y) in enumerate(micro_batches):
            with nullcontext() if i == last else self.model.no_sync():
                loss = next_token_loss(self.model(x.to(self.device)), y.to(self.device), num_tokens)
                loss.backward()
            total += loss.detach()
        grad_norm = self.model.step(lr, self.cfg.grad_clip)
        self.model.comm.all_reduce_scalar(total)
        end = self.counter.snapshot()
        self.last_step_comm = (end[0] - start[0], end[1] - start[1])
        return StepResult(loss=float(total), grad_norm=grad_norm)

    def consolidated_state_dict(self) -> dict[str, torch.Tensor] | None:
        return self.model.full_state_dict()

    def _shard_file(self, directory: Path) -> Path:
        return Path(directory) / f"zero-rank{self.dp_rank:05d}.pt"

    def save_resume_state(self, directory: Path) -> None:
        torch.save(self.model.shard_state_dict(), self._shard_file(directory))

    def load_resume_state(self, directory: Path) -> None:
        path = self._shard_file(directory)
        if not path.is_file():
            raise FileNotFoundError(f"no ZeRO shard {path.name} in {str(directory)!r} (saved with another "
                                    "world size?)")
        keys = ("stage", "world", "geometry", "adam_step", "units")
        self.model.load_shard_state_dict(load_resume_file(path, keys, "ZeRO resume shard", self.device))

    def memory_report(self) -> MemoryReport:
        """What this rank holds beside §3.1's formula (nano_zero.ledger.memory_report)."""
        return memory_report(self.model)


__all__ = ["ZeroEngine", "init_like_build_model"]
