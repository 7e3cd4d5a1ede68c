"""The arguments of `LLM.generate`, checked before anything is queued: vLLM's prompt forms and sampling params.

A prompt is text, a list of token ids, or vLLM's `{"prompt": text}` / `{"prompt_token_ids": ids}`; the
sampling parameters are one `SamplingParams` for every prompt or a list with one each. Anything else
raises TypeError naming the argument (`prompts[2]`, `sampling_params`) and what was given.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from nano_vllm.sampling_params import SamplingParams

Prompt = str | list[int]


def parse_prompts(prompts: Any) -> list[Prompt]:
    """`prompts` (one prompt or a list of them) as a list of texts and token-id lists."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, Seq) and prompts and isinstance(prompts[0], int)):
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
            raise ValueError(f"{name}: a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Seq) and not isinstance(prompt, (bytes, bytearray)):
        return list(prompt)
    raise TypeError(f"{name} must be a str, a list of token ids or a dict with 'prompt' / 'prompt_token_ids', "
                    f"got {type(prompt).__name__}")


def parse_sampling_params(sampling_params: Any, num_prompts: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: `None` (the defaults), one for all, or a list with one each."""
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * num_prompts
    if not isinstance(sampling_params, (list, tuple)):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them (one per prompt), got "
                        f"{type(sampling_params).__name__}")
    for i, sp in enumerate(sampling_params):
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(sp).__name__}")
    if len(sampling_params) != num_prompts:
        raise ValueError(f"got {len(sampling_params)} SamplingParams for {num_prompts} prompts")
    return list(sampling_params)
