"""`LLMEngine` (a scheduler and a model runner, stepped) and `LLM`, vLLM's offline entry point.

    from nano_vllm import LLM, SamplingParams
    llm = LLM("qwen3-0.6b", max_model_len=4096)            # or an HF checkpoint directory
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=32))
    outs[0].text, outs[0].token_ids                          # also outs[0].outputs[0].text, like vLLM

A request's way through: `LLM.generate` checks every prompt, then `add_request` queues each as a
`Sequence` (sequence.py). Each `step()` is one iteration of continuous batching: the scheduler picks the
sequences that run and how many tokens each computes (scheduler.py, §4.5), giving them KV blocks
(block_manager.py, §4.2); the model runner packs them into one batch, runs the model with PagedAttention
(model_runner.py, attention.py, §4.1, §4.3) and samples the next tokens (sampler.py); the scheduler
appends them and finishes the sequences that are done. `LLM.generate` steps until none is left.

Performance layers (nano_vllm/layers/: CUDA graphs, overlapped scheduling, fused projections and
sampling, the GEMV, the kernel warm-up) run by default wherever they apply: the runner's at its points,
the engine's ("engine": overlapped steps, the warm-up) once it is built; `engine.layers_applied` names
them. `LLM(model, performance_layers=False)` runs the paper path alone.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from nano_vllm.block_manager import BlockManager
from nano_vllm.config import EngineConfig, apply_layers
from nano_vllm.inputs import (
    check_request_params,
    parse_prompts,
    parse_sampling_params,
    prompt_token_ids,
    prompts_token_ids,
)
from nano_vllm.model_runner import ModelRunner
from nano_vllm.outputs import Progress, RequestOutput
from nano_vllm.sampling_params import SamplingParams
from nano_vllm.scheduler import Scheduler, SchedulerConfig
from nano_vllm.sequence import Sequence
from nano_vllm.tokenizer import StopChecker, checkpoint_eos_ids, get_engine_tokenizer
from shared.config import resolve_model_config


class LLMEngine:
    """A Scheduler, its BlockManager, a ModelRunner and the tokenizer. Not thread-safe: one thread steps it
    (nano_vllm.serve.engine_loop).

    Extension points — a subclass sets these class attributes to swap one part and keep the rest:
      sequence_cls       a `Sequence` subclass carrying extra per-request state; `add_request` passes its
                         keyword arguments to the constructor: `sequence_cls(ids, params, request_id,
                         arrival_time, **sequence_kwargs)`.
      block_manager_cls  built as `block_manager_cls(num_blocks, block_size, enable_prefix_caching)`.
      scheduler_cls      built as `scheduler_cls(SchedulerConfig, block_manager, eos_token_ids)`.
      model_runner_cls   built as `model_runner_cls(EngineConfig, ModelConfig, max_model_len)`;
                         `tensor_parallel_size > 1` always uses nano_vllm.tp.TPModelRunner.
    A part that needs more constructor arguments is set on the instance before `super().__init__`, e.g.
    `self.scheduler_cls = functools.partial(MyScheduler, policy=policy)`.
    """

    sequence_cls: type[Sequence] = Sequence
    block_manager_cls: type[BlockManager] = BlockManager
    scheduler_cls: type[Scheduler] = Scheduler
    model_runner_cls: type[ModelRunner] = ModelRunner

    def __init__(self, config: EngineConfig):
        self.config, self.model_config = config, resolve_model_config(config.model)
        self.max_model_len = config.resolve_max_model_len(self.model_config)
        self.tokenizer = get_engine_tokenizer(config.model)
        runner_cls = self.model_runner_cls
        if config.tensor_parallel_size > 1:
            # §4.6; it spawns worker processes, so only when asked for
            from nano_vllm.tp import TPModelRunner

            runner_cls = TPModelRunner
        self.model_runner = runner_cls(config, self.model_config, self.max_model_len)
        self.block_manager = self.block_manager_cls(self.model_runner.num_blocks, config.block_size,
                                                    config.enable_prefix_caching)
        sched = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                self.max_model_len, config.enable_chunked_prefill)
        eos = checkpoint_eos_ids(config.model, self.model_config, self.tokenizer)
        self.scheduler = self.scheduler_cls(sched, self.block_manager, eos)
        self.num_steps = 0
        with config.layers_context():
            applied = self.model_runner.layers_applied + apply_layers("engine", self)
        self.layers_applied = list(dict.fromkeys(applied))  # the layers' module names, once each

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | Seq[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    **sequence_kwargs: Any) -> Sequence:
        """Queue one sample of a request (n = 1: `LLM.generate` queues n, `SamplingParams.child`);
        `sequence_kwargs` go to `sequence_cls`. Raises TypeError / ValueError for a bad prompt
        (`inputs.prompt_token_ids`) or sampling_params before anything is queued."""
        ids = prompt_token_ids(prompt, self.tokenizer, self.model_config.vocab_size,
                               self.max_model_len)
        params = check_request_params(sampling_params, self.config.max_logprobs, one_sample=True)
        seq = self.sequence_cls(ids, params, request_id, arrival_time, **sequence_kwargs)
        if params.stop:
            seq.stop_checker = StopChecker(self.tokenizer, params)
        if params.logprobs is not None or params.prompt_logprobs is not None:
            self.model_runner.scored_seqs.add(seq)
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
        out = self.scheduler.schedule()
        if not out.seqs:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress: the KV cache cannot fit any "
                                   "waiting request")
            return [], []
        try:
            tokens = self.model_runner.execute(out)
        except BaseException:
            # This step's K/V were never written, yet the blocks it fills are already hashed: forget every
            # hash rather than let a later request hit garbage. (The caller aborts the requests.)
            self.block_manager.reset_prefix_cache()
            raise
        finished = self.scheduler.postprocess(out, tokens)
        for seq in finished:
            self.model_runner.release(seq)
        self.num_steps += 1
        return [s for s, sampled in zip(out.seqs, out.samples) if sampled], finished

    def output_of(self, seq: Sequence | list[Sequence], prompt: str | None = None) -> RequestOutput:
        """The RequestOutput of a request — one Sequence, or its n samples — each text detokenized as its
        SamplingParams say: cut at a stop string; without the stop token's text, which `token_ids` keep,
        unless `include_stop_str_in_output`."""
        seqs = [seq] if isinstance(seq, Sequence) else seq
        texts = [s.stop_checker.text if s.stop_checker and s.stop_checker.matched else
                 self.tokenizer.decode(s.text_token_ids, s.sampling_params.skip_special_tokens)
                 for s in seqs]
        return RequestOutput.of(seqs, texts, prompt, self.tokenizer)

    def shutdown(self) -> None:
        shutdown = getattr(self.model_runner, "shutdown", None)
        if shutdown is not None:
            shutdown()


class LLM:
    """vLLM's offline API: `LLM(model, **engine_args).generate(prompts, sampling_params)`."""

    def __init__(self, model: str, **engine_args: Any):
        EngineConfig.check_args(engine_args)
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_args))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | Seq[str] | Seq[Seq[int]] | Seq[dict],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt — strings, token-id lists, or vLLM's {"prompt": str} /
        {"prompt_token_ids": [...]} dicts; one SamplingParams for all or one each. Every prompt is checked
        before any is queued. Results in input order."""
        engine, prompts = self.engine, parse_prompts(prompts)
        params = parse_sampling_params(sampling_params, len(prompts), engine.config.max_logprobs)
        ids = prompts_token_ids(prompts, self.tokenizer, engine.model_config.vocab_size,
                                engine.max_model_len)
        # n samples of a prompt are n sequences; the later ones share its KV blocks (prefix cache, §4.4)
        samples = [[engine.add_request(p, sp.child(j)) for j in range(sp.n)]
                   for p, sp in zip(ids, params)]
        seqs = [s for group in samples for s in group]
        progress = Progress(len(seqs), use_tqdm)
        try:
            while engine.has_unfinished_requests():
                progress.update(*engine.step())
        except BaseException:
            for seq in seqs:  # leave the engine clean for the next call
                engine.abort_request(seq.request_id)
            raise
        finally:
            progress.close()
        return [engine.output_of(group, p if isinstance(p, str) else None)
                for group, p in zip(samples, prompts)]

    def shutdown(self) -> None:
        self.engine.shutdown()
