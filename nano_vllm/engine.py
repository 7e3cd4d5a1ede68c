"""`LLMEngine` (one scheduler + one model runner, stepped) and `LLM`, vLLM's offline entry point.

    from nano_vllm import LLM, SamplingParams
    llm = LLM("qwen3-0.6b", max_model_len=4096)            # or an HF checkpoint directory
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=32))
    outs[0].text, outs[0].token_ids                          # also outs[0].outputs[0].text, like vLLM

Each `step()` is one iteration of continuous batching: schedule (§4.5), copy-on-write copies, one
forward over the packed batch with PagedAttention (§4.1, §4.3), sample, advance and finish sequences.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path

from nano_vllm.block_manager import BlockManager
from nano_vllm.config import EngineConfig
from nano_vllm.model_runner import ModelRunner
from nano_vllm.sampling_params import SamplingParams
from nano_vllm.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from nano_vllm.sequence import Sequence
from nano_vllm.tokenizer import Tokenizer, get_engine_tokenizer
from shared.config import ModelConfig, resolve_model_config


@dataclass
class CompletionOutput:
    """One generated continuation (vLLM's name)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class RequestOutput:
    """What `LLM.generate` returns per prompt, vLLM-shaped; `.text` / `.token_ids` are the first output's."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids


def _eos_ids(model: str, model_config: ModelConfig, tokenizer: Tokenizer) -> set[int]:
    """config.json's eos_token_id plus generation_config.json's (Qwen3 ends chat turns with either), else
    the tokenizer's end-of-text token."""
    ids: set[int] = set()
    sources = [model_config.eos_token_id]
    gen_cfg = Path(model) / "generation_config.json"
    if gen_cfg.is_file():
        with contextlib.suppress(ValueError):
            sources.append(json.loads(gen_cfg.read_text()).get("eos_token_id"))
    for eos in sources:
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(e for e in eos if isinstance(e, int))
    return ids or set(tokenizer.eos_token_ids)


class LLMEngine:
    """Scheduler + ModelRunner + tokenizer. Not thread-safe: one thread steps it (see nano_vllm.server)."""

    # Extension point: a subclass may run a ModelRunner subclass (nano_sglang adds logits masks and prompt
    # scoring); tensor parallelism always uses TPModelRunner.
    model_runner_cls: type[ModelRunner] = ModelRunner

    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = resolve_model_config(config.model)
        mcfg = self.model_config
        max_len = config.max_model_len or min(mcfg.max_position_embeddings, 4096)
        if max_len > mcfg.max_position_embeddings:
            raise ValueError(f"max_model_len ({max_len}) exceeds the model's max_position_embeddings "
                             f"({mcfg.max_position_embeddings})")
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_len:
            raise ValueError(f"without chunked prefill max_num_batched_tokens ({config.max_num_batched_tokens}) "
                             f"must be >= max_model_len ({max_len}), or a long prompt could never run")
        self.max_model_len = max_len
        self.tokenizer = get_engine_tokenizer(config.model)
        if config.tensor_parallel_size > 1:
            from nano_vllm.tp import TPModelRunner

            self.model_runner = TPModelRunner(config, mcfg, max_len)
        else:
            self.model_runner = self.model_runner_cls(config, mcfg, max_len)
        self.block_manager = BlockManager(self.model_runner.num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        sched = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_len,
                                config.enable_chunked_prefill)
        self.scheduler = Scheduler(sched, self.block_manager, _eos_ids(config.model, mcfg, self.tokenizer))
        self.num_steps = 0
        # Wall seconds per phase of step(), summed (the bench prints them per step): "execute" is the
        # runner's whole call — input preparation on the host, launches, then waiting for the sampled tokens.
        self.step_seconds = {"schedule": 0.0, "execute": 0.0, "postprocess": 0.0}
        # Called at the end of each step with (SchedulerOutput, the step's wall seconds: schedule, execute and
        # postprocess): nano_distserve logs the step shapes and times its simulator is fitted to.
        self.step_observer: Callable[[SchedulerOutput, float], None] | None = None
        if config.torch_device.type == "cuda":
            self._compile_kernels()

    def _compile_kernels(self) -> None:
        """Run each kind of step once before serving, so Triton compiles its kernels now and not inside the
        first requests (seconds): a prefill, a prefill that continues over cached blocks (the paged varlen
        path), a step mixing it with a decode, decodes. Then forget what the warm-up cached."""
        bs, room = self.config.block_size, self.max_model_len - 4
        greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        prompt = [1 + i % 100 for i in range(min(2 * bs + 3, room))]
        self.add_request(prompt, greedy, request_id="warmup-0")
        self.step()
        longer = prompt + [7] * min(bs, room - len(prompt))
        self.add_request(longer, greedy, request_id="warmup-1")  # a prefix hit, in a step with a decode
        self._run_to_completion()
        # Triton compiles one variant of a kernel per "is this int a multiple of 16" pattern of its
        # arguments (token counts among them): the steps above had odd token counts, these multiples of 16.
        aligned = [3 + i % 97 for i in range(min(4 * bs, room) // 16 * 16)]
        self.add_request(aligned, greedy, request_id="warmup-2")
        self._run_to_completion()
        grown = aligned + [9] * min(16, room - len(aligned))
        self.add_request(grown, greedy, request_id="warmup-3")  # a 16-token chunk over cached blocks
        self._run_to_completion()
        self.block_manager.reset_prefix_cache()
        self.num_steps = 0
        self.step_seconds = dict.fromkeys(self.step_seconds, 0.0)

    def _run_to_completion(self) -> None:
        while self.has_unfinished_requests():
            self.step()

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | Seq[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> Sequence:
        """Queue a request (text or token ids). Raises ValueError for an empty or too long prompt, or ids
        outside the vocabulary."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
        if not all(isinstance(t, int) and 0 <= t < self.model_config.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be ints in [0, {self.model_config.vocab_size})")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len ({self.max_model_len})")
        seq = Sequence(ids, sampling_params or SamplingParams(), request_id, arrival_time)
        self.scheduler.add(seq)
        return seq

    def abort_request(self, request_id: str) -> bool:
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            self.model_runner.release(seq)
        return seq is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ one iteration
    def step(self) -> tuple[list[Sequence], list[Sequence]]:
        """Schedule, run and sample one step. Returns (sequences that got a token, finished sequences)."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if not out.seqs:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress: the KV cache cannot fit any waiting request")
            return [], []
        t1 = time.perf_counter()
        try:
            tokens = self.model_runner.execute(out)
        except BaseException:
            # This step's K/V were never written, yet the blocks it fills are already hashed: forget every
            # hash rather than let a later request hit garbage. (The caller aborts the requests.)
            self.block_manager.reset_prefix_cache()
            raise
        t2 = time.perf_counter()
        finished = self.scheduler.postprocess(out, tokens)
        for seq in finished:
            self.model_runner.release(seq)
        self.num_steps += 1
        t3 = time.perf_counter()
        times = self.step_seconds
        times["schedule"] += t1 - t0
        times["execute"] += t2 - t1
        times["postprocess"] += t3 - t2
        if self.step_observer is not None:
            self.step_observer(out, t3 - t0)
        return [s for s, f in zip(out.seqs, out.samples) if f], finished

    def output_of(self, seq: Sequence, prompt: str | None = None) -> RequestOutput:
        token_ids = seq.output_token_ids
        text = self.tokenizer.decode(token_ids)
        metrics = {}
        if seq.token_times:
            metrics["ttft"] = seq.token_times[0] - seq.arrival_time
            if len(seq.token_times) > 1:
                metrics["tpot"] = (seq.token_times[-1] - seq.token_times[0]) / (len(seq.token_times) - 1)
        return RequestOutput(seq.request_id, prompt, seq.prompt_token_ids,
                             [CompletionOutput(0, text, token_ids, seq.finish_reason)], seq.is_finished,
                             seq.num_cached_tokens, metrics)

    def shutdown(self) -> None:
        shutdown = getattr(self.model_runner, "shutdown", None)
        if shutdown is not None:
            shutdown()


class LLM:
    """vLLM's offline API: `LLM(model, **engine_args).generate(prompts, sampling_params)`."""

    def __init__(self, model: str, **engine_args):
        unknown = sorted(set(engine_args) - EngineConfig.field_names())
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; valid: {sorted(EngineConfig.field_names())}")
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_args))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | Seq[str] | Seq[Seq[int]] | Seq[dict],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt — strings, token-id lists, or vLLM's {"prompt": str} /
        {"prompt_token_ids": [...]} dicts; one SamplingParams for all or one each. Results in input order."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt
        prompts = [_unwrap(p) for p in prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        engine = self.engine
        seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        pbar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            pbar = tqdm(total=len(seqs), desc="Processed prompts", dynamic_ncols=True)
        t0, generated = time.perf_counter(), 0
        try:
            while engine.has_unfinished_requests():
                stepped, finished = engine.step()
                generated += len(stepped)
                if pbar is not None:
                    pbar.set_postfix_str(f"{generated / max(time.perf_counter() - t0, 1e-9):.0f} tok/s", refresh=False)
                    pbar.update(len(finished))
        except BaseException:
            for seq in seqs:  # leave the engine clean for the next call
                engine.abort_request(seq.request_id)
            raise
        finally:
            if pbar is not None:
                pbar.close()
        return [engine.output_of(s, p if isinstance(p, str) else None) for s, p in zip(seqs, prompts)]

    def shutdown(self) -> None:
        self.engine.shutdown()


def _unwrap(prompt):
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError(f"a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
    return prompt


def engine_args_from(node: dict) -> dict:
    """The EngineConfig fields of a dict (e.g. a Hydra node), dropping nulls so defaults apply."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(node) - names)
    if unknown:
        raise ValueError(f"unknown engine argument(s) {unknown}; valid: {sorted(names)}")
    return {k: v for k, v in node.items() if v is not None}


def kv_cache_summary(engine: LLMEngine) -> str:
    r = engine.model_runner
    return (f"KV cache: {r.num_blocks} blocks x {engine.config.block_size} tokens = "
            f"{r.num_blocks * engine.config.block_size} tokens, {r.num_blocks * r.block_bytes / 2**30:.2f} GiB"
            f" ({math.floor(r.num_blocks * engine.config.block_size / engine.max_model_len)} full-length sequences)")
