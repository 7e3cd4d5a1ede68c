"""`build_engine`: the MegatronEngine a configuration asks for, with the performance layers that apply.

The paper path (`engine.MegatronEngine` and the files it imports) runs the papers' mechanism and knows no
layer. Each layer is a `MegatronEngine` subclass in `nano_megatron/layers/`, switched by one
`parallel.*` key:

    parallel.cuda_graph            layers/cudagraph.py          CUDAGraphEngine
    parallel.overlap_micro_batches layers/micro_batch_pairs.py  PairedMicroBatchesEngine
    parallel.tp_comm_overlap       layers/overlap.py            TPCommOverlapEngine

Why subclasses: a layer here changes several methods of one training step at once (how a model is
sharded, how the micro-batches run, how `train_step` replays a graph), so the one extension point of this
package, "engine_class", hands out classes, and the engine that runs is the class stacking the chosen
ones, in the order `REGISTRY` lists their modules (the first one's methods win), over MegatronEngine.
Each layer module registers its class with the predicate of where it is on by default: where it applies
and was measured to help (BENCHMARKS.md). A switch is tri-state: null (auto: that predicate), true
(required: a ValueError when the layer file is missing or the layer cannot run here) or false (off).
`performance_layers=False` runs the paper path alone: no layer, and the steps run inside
`nano_flashattn.registry.performance_layers(False)`, so shared.model's kernels take their paper paths too.
Deleting a layer file leaves the rest running (`REGISTRY.missing` says what is absent).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from nano_flashattn.registry import Registry, layers_enabled, performance_layers
from nano_megatron.engine import MegatronEngine, ParallelConfig, default_device
from shared.config import ModelConfig
from shared.model import CausalLM
from shared.train import StepResult, TrainConfig

# the modules in stacking order, each with the `parallel.*` switch of the class it registers
SWITCHES = {"cudagraph": "cuda_graph", "micro_batch_pairs": "overlap_micro_batches",
            "overlap": "tp_comm_overlap"}
REGISTRY = Registry("nano_megatron", points=("engine_class",), modules=tuple(SWITCHES))


@dataclass
class LayerConfig:
    """The performance-layer switches (Hydra: `parallel.<switch>` and the top-level
    `performance_layers`). None: on where the layer applies and was measured to help; True: required;
    False: off. `performance_layers=False`: every layer off, the paper path alone."""

    performance_layers: bool = True
    tp_comm_overlap: bool | None = None
    cuda_graph: bool | None = None
    overlap_micro_batches: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.performance_layers, bool):
            raise TypeError(f"performance_layers must be true or false, got {self.performance_layers!r}")
        for switch in SWITCHES.values():
            value = getattr(self, switch)
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"parallel.{switch} must be null, true or false, got {value!r}")

    def asked(self) -> list[str]:
        """The switches set to true."""
        return [s for s in SWITCHES.values() if getattr(self, s) is True]


def split_layer_switches(values: dict) -> tuple[dict, dict]:
    """(ParallelConfig fields, LayerConfig fields) of one `parallel` mapping."""
    names = {f.name for f in fields(LayerConfig)}
    return ({k: v for k, v in values.items() if k not in names},
            {k: v for k, v in values.items() if k in names})


class PaperPathEngine(MegatronEngine):
    """MegatronEngine whose steps run under `performance_layers(False)`: the paper path of this package
    and of every kernel shared.model calls."""

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> StepResult:
        with performance_layers(False):
            return super().train_step(micro_batches, lr)

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        with performance_layers(False):
            return super().forward_backward(micro_batches)


def engine_class(parallel: ParallelConfig, cfg: TrainConfig, device: torch.device | str,
                 layers: LayerConfig | None = None) -> type[MegatronEngine]:
    """MegatronEngine, or the class stacking the layers `layers` asks for and those that apply here."""
    layers = layers or LayerConfig()
    asked = layers.asked()
    if not (layers.performance_layers and layers_enabled()):
        if asked:
            raise ValueError(f"parallel.{asked[0]}=true asks for a performance layer, and "
                             "performance_layers=false runs the paper path alone")
        return PaperPathEngine
    for module, switch in SWITCHES.items():
        if switch in asked:
            REGISTRY.require(module, f"parallel.{switch}=true")
    # auto: the predicate each layer registered, called as applies(parallel=, cfg=, device=)
    auto = REGISTRY.active("engine_class", parallel=parallel, cfg=cfg, device=torch.device(device))
    classes = []
    for layer in REGISTRY.layers("engine_class"):
        switch = layer.impl.switch  # every class registered here names its switch
        if switch in asked or (layer.impl in auto and getattr(layers, switch) is None):
            classes.append(layer.impl)
    if not classes:
        return MegatronEngine
    if len(classes) == 1:
        return classes[0]
    return type("+".join(c.__name__ for c in classes), tuple(classes), {})


def build_engine(model_config: ModelConfig, parallel: ParallelConfig, cfg: TrainConfig,
                 device: torch.device | str | None = None, model: CausalLM | None = None,
                 layers: LayerConfig | None = None) -> MegatronEngine:
    """`MegatronEngine(...)` with the performance layers of `layers` (collective: builds the grid)."""
    layers = layers or LayerConfig()
    device = device if device is not None else default_device()
    cls = engine_class(parallel, cfg, device, layers)
    with performance_layers(layers.performance_layers and layers_enabled()):
        return cls(model_config, parallel, cfg, device=device, model=model)


def layer_names(engine: MegatronEngine) -> list[str]:
    """The switches of the layers `engine` runs."""
    return [c.switch for c in type(engine).__mro__ if "switch" in vars(c)]
