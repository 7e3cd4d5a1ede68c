"""The performance layers, in one place: what each one is, where it hooks in, and which switch turns it on.

The paper path (sequence, block manager, scheduler, attention, model runner, sampler, engine) runs alone,
and `LLM` uses it as is. The layers make it fast without changing a greedy token; `register_layers`
(called when nano_vllm is imported) puts each into the hook of the paper path it extends:

| layer | hook | on when |
|---|---|---|
| CUDA graphs (nano_vllm.cudagraph) | `ModelRunner.graph_capturers` | CUDA and not `enforce_eager` |
| nano_quant's Triton kernels (nano_quant.kernels) | `ModelRunner.runner_layers` | a quantized model on CUDA |
| fused q/k/v and gate/up (nano_vllm.fused) | `ModelRunner.runner_layers` | `fused_projections` |
| split-K GEMV (nano_vllm.gemv) | `ModelRunner.runner_layers` | `gemv_max_tokens` > 0, on CUDA |
| fused sampling (nano_vllm.fused_sampling) | `ModelRunner.runner_layers` | `fused_sampling` |
| future tokens + overlapped steps (nano_vllm.overlap) | `runner_layers`, `LLMEngine.engine_layers` | `async_scheduling` |
| kernel warm-up (nano_vllm.warmup) | `with_performance_layers(engine)` | CUDA |

The switches are `EngineConfig` fields, off by default; the bench and the server turn on
`PERFORMANCE_ENGINE_ARGS` (`performance_engine_args`), each key overridable on their command lines
(`engine.async_scheduling=false`). Runner layers run on
every tensor-parallel rank, since each rank builds its runner from the same EngineConfig. Step timing
(nano_vllm.step_timing) is a measurement hook the benches install themselves.

The bench, the server, nano_sglang's runtime and bench and nano_distserve's instances call
`with_performance_layers`.
"""

from __future__ import annotations

from typing import Any, TypeVar

from nano_vllm.config import EngineConfig
from nano_vllm.cudagraph import capture_cudagraphs
from nano_vllm.engine import LLMEngine
from nano_vllm.fused import apply_fused_projections
from nano_vllm.fused_sampling import apply_fused_sampling
from nano_vllm.gemv import apply_gemv
from nano_vllm.model_runner import ModelRunner
from nano_vllm.overlap import install_future_tokens, install_overlap
from nano_vllm.warmup import warm_up

Engine = TypeVar("Engine", bound=LLMEngine)

# The engine arguments the bench and the server turn on (their configs list them; the crossover of the
# GEMV is a measured number: `python -m nano_vllm.bench gemv=true` prints it).
# The GEMV takes one-row steps (M = 1, where its measured tiles beat cuBLAS on every llama3-8b shape; the
# bench's crossover): on an H200 (2026-12-01, `python -m nano_vllm.bench model=llama3-8b workload=batch1`,
# the other layers on) batch-1 decode ran 213.8 tok/s with it and 195.5 with cuBLAS (`gemv_max_tokens=0`).
# Steps that carry prompt tokens are captured too, at these token counts (those within the step budget,
# `max_num_batched_tokens`): an eager step is host-bound, and with overlapped scheduling a new request's
# first token waited for it. On an H200 (2026-12-01, the published workload replayed open-loop at 20 req/s,
# first engine of a process) TTFT P50 went from 42-76 ms without them to 12.7 ms, TPOT P50 from 6.5-9.3 to
# 3.1 ms.
PERFORMANCE_ENGINE_ARGS: dict[str, Any] = {"async_scheduling": True, "fused_projections": True,
                                           "fused_sampling": True, "gemv_max_tokens": 1,
                                           "mixed_cudagraph_sizes": (128, 256, 512, 1024, 1536, 2048)}



def use_quantized_kernels(runner: ModelRunner) -> None:
    """The runner layer for a quantized model on CUDA (`quantization_config` on the model: nano_quant loaded
    it): import nano_quant.kernels, which registers its Triton GEMMs into the quantized layers, before the
    KV cache is profiled and graphs are captured. Without it those layers run their torch references."""
    if runner.device.type == "cuda" and getattr(runner.model, "quantization_config", None) is not None:
        import nano_quant.kernels  # noqa: F401  (registers on import)


# Order matters: the projections are fused before the GEMV swaps every Linear (the fused ones included).
RUNNER_LAYERS = (use_quantized_kernels, apply_fused_projections, apply_gemv, apply_fused_sampling,
                 install_future_tokens)


def performance_engine_args(engine_args: dict[str, Any]) -> dict[str, Any]:
    """`engine_args` with every layer switch it does not set taken from PERFORMANCE_ENGINE_ARGS; overlapped
    scheduling stays off with tensor_parallel_size > 1 unless asked for (it needs one device), so do the
    mixed-step graphs (not measured across ranks), and their sizes stop at the step budget."""
    defaults = dict(PERFORMANCE_ENGINE_ARGS)
    if engine_args.get("tensor_parallel_size", 1) > 1:
        defaults["async_scheduling"] = False
        defaults["mixed_cudagraph_sizes"] = ()  # not measured across ranks yet; decode graphs only
    budget = engine_args.get("max_num_batched_tokens", EngineConfig.max_num_batched_tokens)
    if isinstance(budget, int):  # a bad value is EngineConfig's to report
        defaults["mixed_cudagraph_sizes"] = tuple(s for s in defaults["mixed_cudagraph_sizes"] if s <= budget)
    return {**defaults, **engine_args}


def register_layers() -> None:
    """Put every layer into its hook (idempotent)."""
    for hooks, layers in ((ModelRunner.graph_capturers, (capture_cudagraphs,)),
                          (ModelRunner.runner_layers, RUNNER_LAYERS), (LLMEngine.engine_layers, (install_overlap,))):
        hooks.extend(layer for layer in layers if layer not in hooks)


def with_performance_layers(engine: Engine) -> Engine:
    """`engine` with the layers an entry point wants that act after construction (the kernel warm-up, on
    CUDA); returns it. The other layers were applied as the engine was built, from its EngineConfig."""
    if engine.config.torch_device.type == "cuda":
        warm_up(engine)
    return engine
