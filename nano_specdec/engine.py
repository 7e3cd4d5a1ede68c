"""`SpecDecodeEngine` and `LLM`: nano_vllm's engine with speculative decoding, through its extension
points (`scheduler_cls`, `model_runner_cls`), and vLLM's `speculative_config`.

    from nano_specdec import LLM
    llm = LLM("tiny", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    outs = llm.generate(["def f(x):"], SamplingParams(temperature=0.0, max_tokens=64))
    llm.engine.num_accepted_tokens, llm.engine.num_draft_tokens

One step (`LLMEngine.step`, unchanged): the scheduler schedules as nano_vllm does and gives each decode
its drafts (scheduler.py, the proposers of proposers.py, medusa.py, eagle.py); the runner scores every sequence's last token
and drafts in one target forward and verifies them (model_runner.py, sampling.py); the scheduler appends
the emitted tokens and rolls the KV cache back to the accepted ones. Medusa's heads and EAGLE's draft
layer read the target's hidden states, which the runner hands them every step. Greedy output is the target's own,
token for token; sampled output is distributed as the target's (Leviathan Appendix A.1).
"""

from __future__ import annotations

from typing import Any

from nano_specdec.config import SpeculativeConfig, apply_layers
from nano_specdec.eagle import EagleProposer
from nano_specdec.medusa import MedusaProposer
from nano_specdec.memory import draft_bytes
from nano_specdec.model_runner import SpecModelRunner
from nano_specdec.proposers import DraftModelProposer, NgramProposer, Proposer
from nano_specdec.scheduler import SpecScheduler
from nano_specdec.stats import SpecDecodeStats
from nano_vllm.config import EngineConfig
from nano_vllm.engine import LLM as PlainLLM
from nano_vllm.engine import LLMEngine
from shared.config import resolve_model_config


class SpecDecodeEngine(LLMEngine):
    """nano_vllm's engine; `speculative_config` (a dict with vLLM's keys, or a SpeculativeConfig) says
    which proposer drafts and how many tokens. Every bad value is an error before the target loads."""

    scheduler_cls = SpecScheduler
    model_runner_cls = SpecModelRunner

    def __init__(self, config: EngineConfig, speculative_config: Any):
        spec = SpeculativeConfig.of(speculative_config)
        if config.tensor_parallel_size != 1:
            raise ValueError("nano_specdec runs on one device: tensor_parallel_size must be 1")
        draft_config = None
        if spec.method != "ngram":
            draft_config = resolve_model_config(spec.model)
            spec.check_draft(draft_config, resolve_model_config(config.model), config.model)
        # a draft model's (EAGLE's) own pool, sized with the target's; the target's hidden states for
        # Medusa / EAGLE; k + 1 logits rows a sequence in a verify graph
        self.model_runner_cls = type("SpecModelRunner", (SpecModelRunner,), {
            "draft_bytes": draft_bytes(config, draft_config, spec.method),
            "keeps_hidden": spec.method in ("medusa", "eagle"),
            "sample_rows_per_seq": spec.num_speculative_tokens + 1})
        super().__init__(config)
        if draft_config is not None and draft_config.max_position_embeddings < self.max_model_len:
            raise ValueError(f"speculative_config: the draft's max_position_embeddings "
                             f"({draft_config.max_position_embeddings}) is below max_model_len "
                             f"({self.max_model_len})")
        self.speculative_config = spec
        target_model = self.model_runner.model
        args = (config, spec.model, draft_config, self.model_runner.num_blocks, self.max_model_len)
        self.proposer: Proposer = (
            NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max) if spec.method == "ngram"
            else MedusaProposer(spec.model, target_model, spec.num_speculative_tokens)
            if spec.method == "medusa"
            else EagleProposer(*args, target_model) if spec.method == "eagle"
            else DraftModelProposer(*args))
        if hasattr(self.proposer, "observe"):  # it drafts from the target's hidden states
            self.model_runner.proposer = self.proposer
        self.scheduler.proposer = self.proposer
        self.scheduler.num_speculative_tokens = spec.num_speculative_tokens
        self.scheduler.disable_by_batch_size = spec.disable_by_batch_size
        with config.layers_context():  # nano_specdec's performance layers (nano_specdec/layers)
            self.layers_applied += apply_layers("proposer", self)

    @property
    def spec_decode_stats(self) -> SpecDecodeStats:
        return self.scheduler.stats

    @property
    def num_draft_tokens(self) -> int:
        return self.scheduler.stats.num_draft_tokens

    @property
    def num_accepted_tokens(self) -> int:
        return self.scheduler.stats.num_accepted_tokens


class LLM(PlainLLM):
    """vLLM's offline API with speculative decoding:
    `LLM(model, speculative_config={...}, **engine_args).generate(prompts, sampling_params)`."""

    def __init__(self, model: str, speculative_config: Any = None, **engine_args: Any):
        if speculative_config is None:
            raise TypeError("nano_specdec.LLM needs speculative_config (for plain decoding use "
                            "nano_vllm.LLM)")
        EngineConfig.check_args(engine_args)
        self.engine = SpecDecodeEngine(EngineConfig(model=str(model), **engine_args),
                                       speculative_config)
        self.tokenizer = self.engine.tokenizer
