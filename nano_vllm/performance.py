"""The performance layers an entry point turns on: `with_performance_layers(engine)`.

The paper path (sequence, block manager, scheduler, attention, model runner, sampler, engine) runs
alone, and `LLM` uses it as is. The layers make it fast without changing a token:

* CUDA graphs (nano_vllm.cudagraph) — registered into `ModelRunner.graph_capturers` when nano_vllm is
  imported, so every CUDA runner captures them (unless `enforce_eager`): decode steps always, other
  steps at `mixed_cudagraph_sizes`.
* The kernel warm-up (nano_vllm.warmup) — applied here, on CUDA: Triton compiles before serving.
* Step timing (nano_vllm.step_timing) — a measurement hook the benches install themselves.

The bench, the server, nano_sglang's runtime and bench, and nano_distserve's instances call this.
"""

from __future__ import annotations

from typing import TypeVar

from nano_vllm.engine import LLMEngine
from nano_vllm.warmup import warm_up

Engine = TypeVar("Engine", bound=LLMEngine)


def with_performance_layers(engine: Engine) -> Engine:
    """`engine` with the layers an entry point wants on (the kernel warm-up on CUDA); returns it."""
    if engine.config.torch_device.type == "cuda":
        warm_up(engine)
    return engine
