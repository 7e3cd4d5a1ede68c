"""The kernel warm-up — a performance layer: compile every Triton kernel variant before serving.

Triton compiles a kernel the first time it meets a new shape class — which kernel (prefill, paged
varlen, decode), and for each integer argument whether it is a multiple of 16 — and a compile takes
seconds. Without a warm-up the first requests a server or benchmark sees pay for it (and a timed run
measures it). `warm_up` runs one of each kind of step through the engine, then forgets what the warm-up
cached. The prompts' token values are arbitrary; their *lengths* are what matter. An "engine" hook, on
CUDA, after the other layers: the steps it runs are the ones the engine will run.
"""

from __future__ import annotations

from nano_vllm.config import REGISTRY
from nano_vllm.engine import LLMEngine
from nano_vllm.sampling_params import SamplingParams


def warm_up(engine: LLMEngine) -> None:
    """A prefill; a prefill that continues over cached blocks (the paged varlen path) in a step with a
    decode, as a prefix hit and as a chunked prompt's later chunks; then the same with token counts that
    are multiples of 16. Leaves no request, no used block, no cached prefix and `num_steps` at 0. Every
    step runs eagerly: the CUDA graphs compiled their kernels when they were captured, and a step no graph
    fits (a prefill longer than the largest mixed-step graph) must not compile its variants in front of a
    user."""
    runner = engine.model_runner
    graphs, runner.cudagraphs = runner.cudagraphs, []
    try:
        _warm_up_steps(engine)
    finally:
        runner.cudagraphs = graphs


def _warm_up_steps(engine: LLMEngine) -> None:
    bs, room = engine.config.block_size, max(1, engine.max_model_len - 4)
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompt = [1 + i % 100 for i in range(min(2 * bs + 3, room))]  # odd length: 2 blocks and 3 tokens
    engine.add_request(prompt, greedy, request_id="warmup-0")
    engine.step()
    longer = prompt + [7] * min(bs, room - len(prompt))
    engine.add_request(longer, greedy, request_id="warmup-1")  # a prefix hit, in a step with a decode
    _run_to_completion(engine)
    if engine.config.enable_chunked_prefill:
        # a prompt chunked beside a decode, prefix caching or not: its first chunk attends to itself
        # (`AttentionContext.fresh`), the next reads the first through the pages (the paged varlen kernel)
        cfg = engine.scheduler.config
        budget, cfg.max_num_batched_tokens = cfg.max_num_batched_tokens, len(prompt) // 2 + 1
        try:
            running = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            engine.add_request(prompt[:5], running, request_id="warmup-c0")  # under a block: no hit
            engine.step()
            fresh = [11 + i % 83 for i in range(len(prompt))]  # token values no other prompt has
            engine.add_request(fresh, greedy, request_id="warmup-c1")
            _run_to_completion(engine)
        finally:
            cfg.max_num_batched_tokens = budget
    aligned = [3 + i % 97 for i in range(min(4 * bs, room) // 16 * 16)]  # now token counts divisible by 16
    if aligned:  # (a max_model_len under 20 has no such prompt)
        engine.add_request(aligned, greedy, request_id="warmup-2")
        _run_to_completion(engine)
        grown = aligned + [9] * min(16, room - len(aligned))
        engine.add_request(grown, greedy, request_id="warmup-3")  # a 16-token chunk over cached blocks
        _run_to_completion(engine)
    engine.block_manager.reset_prefix_cache()
    engine.num_steps = 0


def _run_to_completion(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


REGISTRY.register("engine", warm_up, applies=lambda engine: engine.config.torch_device.type == "cuda")
