"""`SGLEngine`: the SGLang runtime (arXiv 2312.07104) as nano_vllm's `LLMEngine` with four parts swapped
through its extension points; stepped by one thread (nano_sglang.backend.runtime runs it for the
frontend).

* `sequence_cls = SGLSequence` — a request with a regex / JSON-schema constraint or prompt scoring;
* `block_manager_cls = RadixBlockManager` — §3 RadixAttention: the radix tree as the prefix cache;
* `scheduler_cls = CacheAwareScheduler` — §3 cache-aware scheduling, §4 jump-forward;
* `model_runner_cls = SGLModelRunner` — prompt scoring for `select` (§2), FSM token masks (§4).

Everything else — the paged KV pool, chunked prefill, preemption, kernels, sampling — is nano_vllm's.

    from nano_sglang import CacheAwareConfig, SGLEngine
    from nano_vllm import EngineConfig, SamplingParams
    engine = SGLEngine(EngineConfig(model="tiny"), CacheAwareConfig("lpm"))
    outs = engine.generate(["Hello", "Hello there"], SamplingParams(temperature=0, max_tokens=8))
    engine.generate(["Name: "], regex=r"[A-Z][a-z]{1,8}")
"""

from __future__ import annotations

import functools
from collections.abc import Sequence as Seq

from nano_sglang.block_manager import RadixBlockManager
from nano_sglang.constrained import Constraint, TokenIndex
from nano_sglang.model_runner import SGLModelRunner
from nano_sglang.scheduler import CacheAwareConfig, CacheAwareScheduler
from nano_sglang.sequence import SGLSequence
from nano_vllm.config import EngineConfig
from nano_vllm.engine import LLMEngine, RequestOutput
from nano_vllm.sampling_params import SamplingParams


class SGLEngine(LLMEngine):
    """nano_vllm's engine with SGLang's parts (module docstring); `policy` configures the scheduler."""

    sequence_cls = SGLSequence
    block_manager_cls = RadixBlockManager
    model_runner_cls = SGLModelRunner

    def __init__(self, config: EngineConfig, policy: CacheAwareConfig | None = None):
        if config.tensor_parallel_size != 1:
            raise ValueError("nano_sglang runs on one device: tensor_parallel_size must be 1")
        # The fourth part takes the policy, so it is set on the instance (nano_vllm's way for a part
        # that needs more constructor arguments).
        self.scheduler_cls = functools.partial(CacheAwareScheduler, policy=policy)
        super().__init__(config)

    @functools.cached_property
    def token_index(self) -> TokenIndex:
        """The vocabulary's character trie for constrained decoding (§4), built on first use (it decodes
        every token id once)."""
        return TokenIndex(self.tokenizer, self.model_config.vocab_size,
                          self.scheduler.eos_token_ids)

    def add_request(self, prompt: str | Seq[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None, *,
                    regex: str | None = None, json_schema: dict | None = None,
                    jump_forward: bool = True, score_from: int | None = None) -> SGLSequence:
        """nano_vllm's add_request plus a regex / JSON-schema constraint (§4) and prompt scoring (§2,
        `score_from`: the log-probabilities of prompt tokens [score_from, len) land in
        `seq.prompt_logprobs`). Bad constraints raise ValueError before anything is queued."""
        constraint = None
        if regex is not None or json_schema is not None:
            constraint = Constraint.build(self.token_index, regex, json_schema, jump_forward)
        return super().add_request(prompt, sampling_params, request_id, arrival_time,
                                   constraint=constraint, score_from=score_from)

    def generate(self, prompts: Seq[str | Seq[int]], sampling_params: SamplingParams | None = None,
                 **constraint) -> list[RequestOutput]:
        """Offline batch: run every prompt to completion (one SamplingParams, one optional constraint)."""
        seqs: list[SGLSequence] = []
        try:  # a bad prompt or constraint further down the list leaves nothing queued
            for p in prompts:
                seqs.append(self.add_request(p, sampling_params, **constraint))
            while self.has_unfinished_requests():
                self.step()
        except BaseException:
            for s in seqs:
                self.abort_request(s.request_id)
            raise
        return [self.output_of(s, p if isinstance(p, str) else None) for s, p in zip(seqs, prompts)]
