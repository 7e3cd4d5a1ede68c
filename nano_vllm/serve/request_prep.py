"""Turning a request body into (request, prompt token ids, sampling params), off the asyncio loop.

Everything here runs before a request reaches the engine, and everything whose cost the body's size
decides — decoding the JSON, validating it, rendering the chat template, tokenizing — runs on a thread of
its own (`off_loop`), so the server's asyncio loop (and `/health`) answers meanwhile. A text prompt longer
than `max_model_len` tokens could possibly be — more characters than max_model_len times the tokenizer's
longest token (`Tokenizer.max_token_chars`) — is refused before it is tokenized.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading

from nano_vllm.inputs import check_request_params
from nano_vllm.sampling_params import SamplingParams
from nano_vllm.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_request,
)

PREPARE_THREADS = 4  # requests parsed and tokenized at once, each on a thread of its own


class RequestPreparation:
    """The checks and conversions of a request, for `OpenAIServer` (which sets `engine`, `tokenizer`,
    `model_name`, `max_model_len` before calling `__init__` here)."""

    def __init__(self) -> None:
        # No text of more characters than this fits max_model_len tokens: refused untokenized
        self.max_prompt_chars = self.max_model_len * self.tokenizer.max_token_chars
        self._prepare_slots = asyncio.Semaphore(PREPARE_THREADS)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "not_found_error")

    def check_ids(self, ids: list[int]) -> list[int]:
        vocab = self.engine.model_config.vocab_size
        if not ids:
            raise APIError(400, "prompt is empty", "prompt")
        if len(ids) >= self.max_model_len:  # first: it costs nothing, the scan below a pass over the ids
            raise APIError(400, f"prompt has {len(ids)} tokens; this model's maximum context length is "
                                f"{self.max_model_len} (prompt + at least one output token)", "prompt")
        if any(t < 0 or t >= vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        return ids

    def check_length(self, num_chars: int, param: str) -> None:
        """Refuse, untokenized, a text too long for `max_model_len` tokens whatever its tokens."""
        if num_chars > self.max_prompt_chars:
            raise APIError(400, f"{param} has {num_chars:,} characters, more than this model's maximum context "
                                f"length of {self.max_model_len} tokens can hold (max_model_len {self.max_model_len} "
                                f"x at most {self.tokenizer.max_token_chars} characters per token); it was not "
                                f"tokenized", param)

    def prompts_ids(self, req: CompletionRequest | ChatCompletionRequest) -> list[list[int]]:
        """The token ids of each prompt of the request (a chat has one)."""
        chat = isinstance(req, ChatCompletionRequest)
        num_prompts, limit = 1 if chat else len(req.prompt), self.engine.config.max_num_seqs
        if num_prompts * req.n > limit:
            raise APIError(400, f"{num_prompts} prompt(s) x n={req.n} is {num_prompts * req.n} choices, "
                                f"more than this server runs at once (max_num_seqs: {limit})",
                           "n" if req.n > 1 else "prompt")
        if chat:
            return [self.prompt_ids(req)]
        ids = []
        for prompt in req.prompt:
            if isinstance(prompt, str):
                self.check_length(len(prompt), "prompt")
                prompt = self.tokenizer.encode(prompt)
            ids.append(self.check_ids(prompt))
        return ids

    def prompt_ids(self, req: ChatCompletionRequest) -> list[int]:
        self.check_length(sum(len(m.content) for m in req.messages), "messages")
        messages = [{"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})}
                    for m in req.messages]  # a name reaches the template, which may render it (vLLM's way)
        try:
            text = self.tokenizer.apply_chat_template(messages)
        except (ValueError, TypeError) as e:
            raise APIError(400, f"chat template failed: {e}", "messages") from None
        if not isinstance(text, str):
            return self.check_ids(list(text))
        self.check_length(len(text), "messages")
        return self.check_ids(self.tokenizer.encode(text))

    def sampling_params(self, req: CompletionRequest | ChatCompletionRequest, n_prompt: int) -> SamplingParams:
        """The request's SamplingParams for its longest prompt (`n_prompt` tokens). `max_tokens: 0` (with
        `echo`) runs one token, which the response leaves out (`scores_prompt_only`)."""
        chat = isinstance(req, ChatCompletionRequest)
        max_tokens = req.max_completion_tokens if chat and req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:  # OpenAI's chat default is "as many as fit"; completions default to 16 (vLLM)
            max_tokens = self.max_model_len - n_prompt if chat else 16
        if max_tokens == 0 and not chat and req.echo:
            max_tokens = 1
        elif max_tokens == 0:
            raise APIError(400, "max_tokens must be >= 1 (0 is allowed with echo: score the prompt only)",
                           "max_completion_tokens" if chat and req.max_completion_tokens is not None
                           else "max_tokens")
        if chat:
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            prompt_logprobs = None
            names = {"logprobs": "top_logprobs"}
        else:
            logprobs = req.logprobs
            prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
            names = {}
        try:
            params = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                    max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                    stop_token_ids=req.stop_token_ids, seed=req.seed,
                                    skip_special_tokens=req.skip_special_tokens,
                                    include_stop_str_in_output=req.include_stop_str_in_output,
                                    n=req.n, stop=req.stop, logprobs=logprobs,
                                    prompt_logprobs=prompt_logprobs)
            check_request_params(params, self.engine.config.max_logprobs)
        except ValueError as e:
            field = str(e).split()[0].split("=")[0]
            raise APIError(400, str(e), names.get(field, field)) from None
        if n_prompt + params.max_tokens > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                f"you requested {n_prompt + params.max_tokens} tokens ({n_prompt} in the prompt, "
                                f"{params.max_tokens} for the completion).", "max_tokens")
        return params

    def prepare(self, raw: bytes, model: type[CompletionRequest | ChatCompletionRequest]
                ) -> tuple[CompletionRequest | ChatCompletionRequest, list[list[int]], SamplingParams]:
        """A request body -> (request, each prompt's ids, sampling params), or an APIError: all the work
        whose cost the body's size decides (run off the asyncio loop: `off_loop`)."""
        try:
            body = json.loads(raw)
        except RecursionError:
            raise APIError(400, "malformed JSON body: nested too deeply") from None
        except ValueError as e:  # includes UnicodeDecodeError
            raise APIError(400, f"malformed JSON body: {e}") from None
        req = parse_request(model, body)
        self.check_model(req.model)
        ids = self.prompts_ids(req)
        return req, ids, self.sampling_params(req, max(map(len, ids)))

    # ------------------------------------------------------------------ vLLM's tokenizer routes
    def _body(self, raw: bytes, model: type):
        try:
            body = json.loads(raw)
        except (RecursionError, ValueError) as e:
            raise APIError(400, f"malformed JSON body: {e}") from None
        req = parse_request(model, body)
        self.check_model(req.model)
        return req

    def tokenize(self, raw: bytes) -> dict:
        """`POST /tokenize`: {"count", "max_model_len", "tokens"} of a text (vLLM's response)."""
        req = self._body(raw, TokenizeRequest)
        self.check_length(len(req.prompt), "prompt")
        ids = self.tokenizer.encode(req.prompt)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}

    def detokenize(self, raw: bytes) -> dict:
        """`POST /detokenize`: {"prompt"}, the text of token ids."""
        req = self._body(raw, DetokenizeRequest)
        vocab = self.engine.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in req.tokens):
            raise APIError(400, f"tokens must be in [0, {vocab})", "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    def tokenizer_info(self) -> dict:
        """`GET /tokenizer_info`: the special tokens and chat template (vLLM's keys that clients read)."""
        specials = self.tokenizer.special_tokens
        return {"tokenizer_class": type(self.tokenizer).__name__, "name": self.tokenizer.name,
                "eos_token": specials.get("eos_token"), "bos_token": specials.get("bos_token"),
                "pad_token": specials.get("pad_token"), "chat_template": self.tokenizer.chat_template,
                "model_max_length": self.max_model_len}

    async def off_loop(self, fn, *args):
        """`fn(*args)` on a thread of its own (at most PREPARE_THREADS at once; the others wait here), so
        the asyncio loop keeps serving meanwhile; its result or exception."""
        async with self._prepare_slots:
            aloop, done = asyncio.get_running_loop(), asyncio.get_running_loop().create_future()

            def settle(outcome, error: BaseException | None) -> None:
                if done.done():  # the request was cancelled meanwhile
                    return
                if error is None:
                    done.set_result(outcome)
                else:
                    done.set_exception(error)

            def work() -> None:
                try:
                    outcome, error = fn(*args), None
                except Exception as e:
                    outcome, error = None, e
                with contextlib.suppress(RuntimeError):  # the asyncio loop is closed
                    aloop.call_soon_threadsafe(settle, outcome, error)

            threading.Thread(target=work, name="nano_vllm-prepare", daemon=True).start()
            return await done
