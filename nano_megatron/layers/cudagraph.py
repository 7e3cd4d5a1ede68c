"""Performance layer: the whole training step captured once in a CUDA graph and replayed
(`parallel.cuda_graph`; Megatron-Core's full-iteration CUDA graph, PyTorch's whole-network capture).

Forward, backward, the tensor-parallel collectives, clipping and AdamW become one host call per step, so
the host's kernel launches and its jitter leave the critical path. The first `GRAPH_WARMUP_STEPS` steps run
eagerly on a side stream (AdamW's state, Triton's autotuned kernels, cuBLAS workspaces and NCCL
communicators must all exist before a graph records addresses: torch.cuda.graph's documented recipe); the
next is captured; every later step copies its batch into the graph's static input buffers, writes the
learning rate into device memory and replays. One batch shape per engine; CUDA only; pp = dp = 1.

On by default where it applies and was measured: one GPU (tp = pp = dp = 1). One H200, the 1.1B shape of
configs/model/1b.yaml, micro-batch 8, 2026-12-01: +0.9% over the eager step, which is GPU-bound already
(BENCHMARKS.md). With tp > 1 it runs when asked for (`parallel.cuda_graph=true`).
"""

from __future__ import annotations

import time
import warnings

import torch

from nano_megatron.build import REGISTRY
from nano_megatron.engine import MegatronEngine, ParallelConfig, default_device
from shared.config import ModelConfig
from shared.dist import DEFAULT_TIMEOUT_S
from shared.model import CausalLM
from shared.train import StepResult, TrainConfig


class CUDAGraphEngine(MegatronEngine):
    """MegatronEngine whose `train_step` replays one captured CUDA graph of `_step`."""

    switch = "cuda_graph"
    GRAPH_WARMUP_STEPS = 2

    def __init__(self, model_config: ModelConfig, parallel: ParallelConfig, cfg: TrainConfig,
                 device: torch.device | str | None = None, model: CausalLM | None = None) -> None:
        # raised on every rank, before the grid's collectives
        if parallel.pp > 1 or parallel.dp > 1:
            raise ValueError(f"parallel.cuda_graph supports tensor (and sequence) parallelism only: pp and "
                             f"dp must be 1, got pp={parallel.pp}, dp={parallel.dp}")
        dev = torch.device(device) if device is not None else default_device()
        if dev.type != "cuda":
            raise ValueError(f"parallel.cuda_graph needs a CUDA device (the NCCL backend), got {dev}")
        self._lr = torch.tensor(cfg.lr, dtype=torch.float32, device=dev)  # read by the replayed AdamW
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_calls = 0
        self.graph_timeout_s = DEFAULT_TIMEOUT_S  # a replay that takes longer raises (see _wait_for_replay)
        super().__init__(model_config, parallel, cfg, device=device, model=model)

    def _optimizer_options(self) -> dict:
        return {**super()._optimizer_options(), "lr": self._lr, "capturable": True}

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> StepResult:
        """Warm-up steps eagerly on a side stream, then capture, then one replay per call."""
        shapes = [(tuple(x.shape), tuple(y.shape)) for x, y in micro_batches]
        if self._graph_calls == 0:
            self._graph_shapes = shapes
            self._static = [(x.to(self.device, copy=True), y.to(self.device, copy=True))
                            for x, y in micro_batches]
            self._graph_stream = torch.cuda.Stream(self.device)
        elif shapes != self._graph_shapes:
            raise ValueError(f"parallel.cuda_graph replays one batch shape: captured {self._graph_shapes}, "
                             f"got {shapes}")
        for (sx, sy), (x, y) in zip(self._static, micro_batches):
            sx.copy_(x)
            sy.copy_(y)
        self._lr.fill_(lr)
        self._graph_calls += 1
        stream = self._graph_stream
        if self._graph is None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            if self._graph_calls <= self.GRAPH_WARMUP_STEPS:
                with torch.cuda.stream(stream), warnings.catch_warnings():
                    # AdamW(capturable=True) warns when it runs outside a graph: here it is meant to
                    warnings.filterwarnings("ignore", message=".*capturable=True.*")
                    self._out = self._step(self._static, None)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                return StepResult(loss=float(self._out[0]), grad_norm=float(self._out[1]))
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            # thread_local: NCCL's watchdog thread may query events while this thread captures
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                self._out = self._step(self._static, None)
            self._graph = graph
        self._graph.replay()
        self._wait_for_replay()
        return StepResult(loss=float(self._out[0]), grad_norm=float(self._out[1]))

    def _wait_for_replay(self) -> None:
        """Wait for the replayed step, at most the process group's timeout. NCCL's watchdog does not watch
        collectives inside a CUDA graph, so a dead peer would leave this rank spinning in a replayed
        all-reduce forever (torchrun kills the job when a worker exits, a bare launch would not): poll an
        event and raise instead."""
        done = torch.cuda.Event()
        done.record()
        deadline = time.monotonic() + self.graph_timeout_s
        while not done.query():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replayed CUDA-graph step did not finish within "
                                   f"{self.graph_timeout_s:.0f} s (parallel.cuda_graph): a peer rank has "
                                   "probably died or hung")
            time.sleep(2e-4)


def measured_to_help(parallel: ParallelConfig, cfg: TrainConfig, device: torch.device) -> bool:
    """On by default: one GPU, where it was measured (module docstring)."""
    return device.type == "cuda" and parallel.tp == parallel.pp == parallel.dp == 1


REGISTRY.register("engine_class", CUDAGraphEngine, applies=measured_to_help)
