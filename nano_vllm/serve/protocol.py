"""The OpenAI request schema the server accepts, as pydantic models, and its error object.

Types are checked strictly (a string is not a number, 1.0 is not an int) and unknown fields are refused, as
OpenAI's API does; value ranges are checked once, by `SamplingParams`. Fields of the API that this server
does not implement are accepted only with their no-op value (`best_of: 1`, `logit_bias: {}` ...); anything
else is a 400 naming the field, never a silent different answer.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator


class APIError(Exception):
    """An HTTP error with OpenAI's body `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


# field -> (the values that mean "not used", what the server would need to support it)
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "best_of": ((None, 1), "no server-side best-of (ask for n choices and their logprobs)"),
    "suffix": ((None, ""), "no insertion after a suffix"),
    "logit_bias": ((None, {}), "logits are not biased"),
    "presence_penalty": ((None, 0, 0.0), "no penalties"),
    "frequency_penalty": ((None, 0, 0.0), "no penalties"),
    "tools": ((None, ()), "no tool calling"),
    "tool_choice": ((None, "none"), "no tool calling"),
    "functions": ((None, ()), "no function calling"),
    "function_call": ((None, "none"), "no function calling"),
    "parallel_tool_calls": ((None,), "no tool calling"),
    "response_format": ((None, {"type": "text"}), "no structured output (nano_sglang's runtime has it)"),
}


def _is_noop(value: Any, allowed: tuple) -> bool:
    if isinstance(value, list):
        value = tuple(value)
    # bool is an int in Python: `True == 1`, yet `"n": true` is not `"n": 1`
    return any(type(value) is type(a) and value == a for a in allowed if a is not None) or value is None


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class _Base(BaseModel):
    """The fields completions and chat completions share."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    # vLLM's extensions: top_k, ignore_eos, stop_token_ids, seed, skip_special_tokens,
    # include_stop_str_in_output
    top_k: int = -1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int = 1
    stop: str | list[str] | None = None
    # Typed loosely on purpose: `check_supported` names the field with a clearer message than a type error.
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None

    def check_supported(self) -> None:
        for name, (allowed, why) in UNSUPPORTED.items():
            value = getattr(self, name, None)
            if not _is_noop(value, allowed):
                raise APIError(400, f"{name}={value!r} is not supported by this server: {why}", name)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")


class CompletionRequest(_Base):
    """`POST /v1/completions`: one prompt or a batch — a string, a list of token ids, a list of strings or
    a list of token-id lists; one choice per prompt and per `n`, numbered prompt * n + sample as OpenAI
    does. `logprobs: k` (OpenAI's legacy int) returns each token's log-probability and the top k; with
    `echo` the prompt comes first in the text and the log-probabilities, and `max_tokens: 0` scores the
    prompt alone (how evaluation harnesses score multiple-choice answers)."""

    prompt: list[str | list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: Any = None
    suffix: Any = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, v: Any) -> list[str | list[int]]:
        def is_ids(p: Any) -> bool:
            return isinstance(p, list) and all(type(t) is int for t in p)

        if isinstance(v, str) or (is_ids(v) and v):
            return [v]
        if isinstance(v, list) and v and all(isinstance(p, str) or is_ids(p) for p in v):
            return v
        if isinstance(v, list) and not v:
            raise ValueError("prompt is empty")
        raise ValueError("prompt must be a string, a list of token ids (ints), or a list of either")


# OpenAI's message roles this server renders; "developer" is OpenAI's newer name for "system". "tool" and
# "function" messages answer tool calls, which this server does not make.
CHAT_ROLES = ("system", "developer", "user", "assistant")


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: str
    content: str
    name: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, v: str) -> str:
        if v not in CHAT_ROLES:
            why = " (no tool calling)" if v in ("tool", "function") else ""
            raise ValueError(f"{v!r} is not a supported role{why}; allowed: {', '.join(map(repr, CHAT_ROLES))}")
        return "system" if v == "developer" else v

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, v: Any) -> str:
        """A string, or OpenAI's content parts of which only text ones are supported (joined in order)."""
        if isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise ValueError(f"content must be a string or a list of text content parts, got {type(v).__name__}")
        texts = []
        for i, part in enumerate(v):
            if not isinstance(part, dict):
                raise ValueError(f"content part {i} must be an object, got {type(part).__name__}")
            if part.get("type") != "text":
                raise ValueError(f"content part {i} has type {part.get('type')!r}; only 'text' parts are supported")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i}: 'text' must be a string, got {type(part.get('text')).__name__}")
            if set(part) - {"type", "text"}:
                raise ValueError(f"content part {i} has unrecognized fields {sorted(set(part) - {'type', 'text'})}")
            texts.append(part["text"])
        return "".join(texts)


class ChatCompletionRequest(_Base):
    """`POST /v1/chat/completions`: a conversation rendered by the checkpoint's chat template."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False  # chat: whether to return them; top_logprobs says how many alternatives
    top_logprobs: int | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("messages must be a non-empty list")
        return v

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")


class TokenizeRequest(BaseModel):
    """`POST /tokenize` (vLLM's): a text to token ids. `add_special_tokens` is accepted for the clients that
    send it; this server's tokenizers add none."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True

    def check_supported(self) -> None:
        pass


class DetokenizeRequest(BaseModel):
    """`POST /detokenize` (vLLM's): token ids to text."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    tokens: list[int]

    def check_supported(self) -> None:
        pass


def parse_request(model: type[BaseModel], body: Any) -> BaseModel:
    """Validate a decoded JSON body against `model`; a schema violation becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}")
    try:
        request = model.model_validate(body)
    except ValidationError as e:
        raise _api_error(e) from None
    request.check_supported()
    return request


def _api_error(e: ValidationError) -> APIError:
    err = e.errors(include_url=False)[0]
    loc = err["loc"]
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    if err["type"] == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {path}"
    elif err["type"] == "missing":
        message = f"missing required field '{path}'"
    else:
        message = f"{path}: {err['msg'].removeprefix('Value error, ')}"
    return APIError(400, message, str(loc[0]) if loc else None)
