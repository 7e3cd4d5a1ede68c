"""`build_engine`: the MegatronEngine a ParallelConfig asks for, with the performance layers it switches on.

The paper path (`engine.MegatronEngine` and the files it imports) runs the papers' mechanism and imports
no layer. Each layer is a subclass in its own module, named by its config switch:

    parallel.tp_comm_overlap       nano_megatron/overlap.py            TPCommOverlapEngine
    parallel.cuda_graph            nano_megatron/cudagraph.py          CUDAGraphEngine
    parallel.overlap_micro_batches nano_megatron/micro_batch_pairs.py  PairedMicroBatchesEngine

A layer module is imported only when its switch is on, so deleting one leaves everything else running
(asking for it then raises a ValueError naming the missing module).
"""

from __future__ import annotations

import importlib

import torch

from nano_megatron.engine import LAYER_FLAGS, MegatronEngine, ParallelConfig
from shared.config import ModelConfig
from shared.model import CausalLM
from shared.train import TrainConfig

# switch -> (module, class), in the order their subclasses are stacked (the first one's methods win)
LAYERS = {
    "cuda_graph": ("nano_megatron.cudagraph", "CUDAGraphEngine"),
    "overlap_micro_batches": ("nano_megatron.micro_batch_pairs", "PairedMicroBatchesEngine"),
    "tp_comm_overlap": ("nano_megatron.overlap", "TPCommOverlapEngine"),
}
assert set(LAYERS) == set(LAYER_FLAGS)


def engine_class(parallel: ParallelConfig) -> type[MegatronEngine]:
    """MegatronEngine, or a subclass stacking the layer subclasses `parallel` switches on."""
    classes = []
    for flag, (module, name) in LAYERS.items():
        if getattr(parallel, flag):
            try:
                classes.append(getattr(importlib.import_module(module), name))
            except ModuleNotFoundError as e:
                raise ValueError(f"parallel.{flag}=true needs the performance layer {module}, which is not "
                                 f"installed ({e})") from e
    if not classes:
        return MegatronEngine
    if len(classes) == 1:
        return classes[0]
    return type("+".join(c.__name__ for c in classes), tuple(classes), {})


def build_engine(model_config: ModelConfig, parallel: ParallelConfig, cfg: TrainConfig,
                 device: torch.device | str | None = None, model: CausalLM | None = None) -> MegatronEngine:
    """`MegatronEngine(...)` with the performance layers of `parallel` (collective: builds the grid)."""
    return engine_class(parallel)(model_config, parallel, cfg, device=device, model=model)
