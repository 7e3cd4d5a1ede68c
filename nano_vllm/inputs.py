"""A request's inputs, checked before anything is queued: vLLM's prompt forms, token ids, sampling params.

A prompt is text, a list of token ids, or vLLM's `{"prompt": text}` / `{"prompt_token_ids": ids}`; the
sampling parameters are one `SamplingParams` for every prompt or a list with one each. Anything else
raises TypeError naming the argument (`prompts[2]`, `sampling_params`) and what was given; a prompt the
engine cannot run (empty, too long, ids outside the vocabulary) raises ValueError.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from nano_vllm.sampling_params import SamplingParams
from nano_vllm.tokenizer import Tokenizer

Prompt = str | list[int]


def parse_prompts(prompts: Any) -> list[Prompt]:
    """`prompts` (one prompt or a list of them) as a list of texts and token-id lists."""
    one_ids = isinstance(prompts, Seq) and bool(prompts) and isinstance(prompts[0], int)
    if isinstance(prompts, (str, dict)) or one_ids:
        prompts = [prompts]  # one prompt
    if not isinstance(prompts, Seq):
        raise TypeError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
    return [_parse_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]


def _parse_prompt(prompt: Any, name: str) -> Prompt:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            prompt, name = prompt["prompt_token_ids"], f"{name}['prompt_token_ids']"
        elif "prompt" in prompt:
            prompt, name = prompt["prompt"], f"{name}['prompt']"
        else:
            raise ValueError(f"{name}: a dict prompt needs 'prompt' or 'prompt_token_ids', got keys "
                             f"{sorted(prompt)}")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Seq) and not isinstance(prompt, (bytes, bytearray)):
        return list(prompt)
    raise TypeError(f"{name} must be a str, a list of token ids or a dict with 'prompt' / "
                    f"'prompt_token_ids', got {type(prompt).__name__}")


def check_request_params(params: Any, max_logprobs: int, one_sample: bool = False) -> SamplingParams:
    """The SamplingParams of one request (None: the defaults), checked against the engine's limits;
    `one_sample`: what `LLMEngine.add_request` queues, one sequence (n = 1)."""
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    if one_sample and params.n != 1:
        raise ValueError(f"add_request queues one sample (n=1), got n={params.n}: queue "
                         f"`params.child(j)` for j in range(n), as LLM.generate does")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > max_logprobs:
            raise ValueError(f"{name}={value} is more than this engine returns (max_logprobs: "
                             f"{max_logprobs})")
    return params


def parse_sampling_params(sampling_params: Any, num_prompts: int,
                          max_logprobs: int = 20) -> list[SamplingParams]:
    """One SamplingParams per prompt: `None` (the defaults), one for all, or a list with one each; each
    checked by `check_request_params`."""
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [check_request_params(sampling_params, max_logprobs)] * num_prompts
    if not isinstance(sampling_params, (list, tuple)):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them (one per prompt), got "
                        f"{type(sampling_params).__name__}")
    for i, sp in enumerate(sampling_params):
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(sp).__name__}")
    if len(sampling_params) != num_prompts:
        raise ValueError(f"got {len(sampling_params)} SamplingParams for {num_prompts} prompts")
    return [check_request_params(sp, max_logprobs) for sp in sampling_params]


def prompt_token_ids(prompt: Any, tokenizer: Tokenizer, vocab_size: int, max_model_len: int) -> list[int]:
    """The token ids of one prompt (text or ids). Raises TypeError for anything else, ValueError for an
    empty or too long prompt or ids outside the vocabulary."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, Seq) and not isinstance(prompt, (bytes, bytearray)):
        ids = list(prompt)
    else:
        raise TypeError(f"a prompt must be a str or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("prompt is empty (no tokens)")
    if not all(type(t) is int and 0 <= t < vocab_size for t in ids):
        raise ValueError(f"prompt token ids must be ints in [0, {vocab_size})")
    if len(ids) > max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len ({max_model_len})")
    return ids


def prompts_token_ids(prompts: list[Prompt], tokenizer: Tokenizer, vocab_size: int,
                      max_model_len: int) -> list[list[int]]:
    """`prompt_token_ids` of each prompt; an error names the prompt (`prompts[i]: ...`)."""
    ids = []
    for i, prompt in enumerate(prompts):
        try:
            ids.append(prompt_token_ids(prompt, tokenizer, vocab_size, max_model_len))
        except (TypeError, ValueError) as e:
            raise type(e)(f"prompts[{i}]: {e}") from None
    return ids
