"""The messages between a prefill instance, its decode instances and the router (DistServe, arXiv
2401.09670, §4.3: the decode instance *pulls* a prefilled request's K/V when it has room for it).

One request's hand-off, in order:

    prefill -> decode   Ready   the prompt is prefilled; its blocks wait under a lease
    decode -> prefill   Pull    the blocks fit here now: send them with this tag
    prefill -> decode   Sent    the bytes are on their way (or Nack: lease expired, or aborted)
    decode -> prefill   Done    the request ended (finished, or failed: why is in its Completion)

Renew keeps the prefill leases of requests a decode instance holds back for memory; Abort travels from the
router to whoever holds the request; Stop ends a decode instance once it has drained. The K/V bytes
themselves are no message: they travel as one tagged tensor (kv_transfer.Transport.isend_kv).
"""

from __future__ import annotations

from dataclasses import dataclass

from nano_vllm.sampling_params import SamplingParams


@dataclass
class Completion:
    """A request's end, wherever it ended: tokens, token times and why it stopped."""

    request_id: str
    prompt_len: int
    arrival_time: float
    output_token_ids: list[int]
    token_times: list[float]
    finish_time: float
    finish_reason: str | None


@dataclass(frozen=True)
class Ready:
    """Prefill -> decode: prompt prefilled, first token sampled; its blocks wait under a lease."""

    rid: str
    prompt: list[int]
    first_token: int
    first_token_time: float
    arrival_time: float
    sampling_params: SamplingParams
    num_blocks: int


@dataclass(frozen=True)
class Pull:
    """Decode -> prefill: the blocks are allocated here; send them under `tag` (the receive follows)."""

    rid: str
    tag: int  # the tag of the K/V tensor: unique per (prefill, decode) pair


@dataclass(frozen=True)
class Sent:
    """Prefill -> decode: the blocks are on their way under the pull's tag, and freed on the prefill side."""

    rid: str


@dataclass(frozen=True)
class Nack:
    """Prefill -> decode: no blocks for this pull (the lease expired, or the request was aborted)."""

    rid: str


@dataclass(frozen=True)
class Renew:
    """Decode -> prefill: these requests wait for memory here; extend their leases."""

    rids: list[str]


@dataclass(frozen=True)
class Abort:
    """Router -> decode instances: the client went away; free the request wherever it is."""

    rid: str


@dataclass(frozen=True)
class Done:
    """Decode -> router: how a request ended (finished, or failed: transfer_timeout, abort)."""

    completion: Completion


@dataclass(frozen=True)
class Stop:
    """Router -> decode instance: stop once drained."""


Message = Ready | Pull | Sent | Nack | Renew | Abort | Done | Stop
