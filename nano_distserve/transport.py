"""The wire between instances, over torch.distributed: the KV-geometry handshake and `DistTransport`
(a `Transport`: a Store mailbox for the protocol's messages, `dist.isend` / `dist.irecv` for K/V — NCCL on
GPUs, gloo on CPUs).

* `KVGeometry` + `register` / `handshake`: every instance publishes its cache geometry (block size, layers,
  kv heads, head dim, dtype); mismatched instances are rejected before any byte moves, since a block
  copied between different geometries would be silently reinterpreted garbage.
* `Transport`: what an instance needs of the wire — a control plane (nano_distserve.protocol's messages)
  and a data plane (tagged tensor send/recv). `DistTransport` implements it: senders never block on
  receivers, and every transfer has its own tag.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import asdict, dataclass, fields
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from nano_distserve.protocol import Message


class Work(Protocol):
    def is_completed(self) -> bool: ...
    def wait(self) -> object: ...


class Transport(Protocol):
    """Control messages (nano_distserve.protocol) between ranks and tagged K/V tensors (the data plane)."""

    rank: int

    def send(self, dst: int, msg: Message) -> None: ...
    def poll(self) -> list[tuple[int, Message]]: ...  # (sender rank, message), in the order sent
    def isend_kv(self, dst: int, tag: int, tensor: torch.Tensor) -> Work: ...
    def irecv_kv(self, src: int, tag: int, tensor: torch.Tensor) -> Work: ...


@dataclass(frozen=True)
class KVGeometry:
    """What must agree for a block computed on one instance to mean the same on another."""

    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @classmethod
    def of_cache(cls, kv_cache: torch.Tensor) -> KVGeometry:
        _, layers, _, block_size, heads, head_dim = kv_cache.shape
        return cls(block_size, layers, heads, head_dim, str(kv_cache.dtype).removeprefix("torch."))

    def check_compatible(self, other: KVGeometry, me: str, peer: str) -> None:
        diffs = [f"{f.name} {getattr(self, f.name)} != {getattr(other, f.name)}" for f in fields(self)
                 if getattr(self, f.name) != getattr(other, f.name)]
        if diffs:
            raise ValueError(f"KV geometry mismatch between {me} and {peer}: {', '.join(diffs)}; "
                             f"KV blocks cannot move between them")


def register(store, name: str, geometry: KVGeometry, num_blocks: int) -> None:
    """Publish an instance's geometry and cache size (the first half of the handshake)."""
    store.set(f"instance/{name}", json.dumps({**asdict(geometry), "num_blocks": num_blocks}))


def handshake(store, names: list[str], timeout_s: float) -> dict[str, dict]:
    """Wait until every instance in `names` has registered, then check they share one geometry.

    Returns {name: {"geometry": KVGeometry, "num_blocks": int}}. Raises TimeoutError naming the instances
    that never registered, and ValueError on the first geometry mismatch."""
    keys = [f"instance/{n}" for n in names]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as e:  # torch raises DistStoreError (a RuntimeError) on a timeout
        missing = [n for n, k in zip(names, keys) if not store.check([k])]
        raise TimeoutError(f"instance(s) {missing} did not register within {timeout_s} s "
                           f"(never started, crashed, or point at another store)") from e
    info = {}
    for name, key in zip(names, keys):
        d = json.loads(store.get(key))
        num_blocks = d.pop("num_blocks")
        info[name] = {"geometry": KVGeometry(**d), "num_blocks": num_blocks}
    first = names[0]
    for name in names[1:]:
        info[first]["geometry"].check_compatible(info[name]["geometry"], first, name)
    return info


class DistTransport:
    """Store mailbox for control messages, `dist.isend` / `dist.irecv` for K/V.

    A mailbox is a counter `mb/<rank>/n` plus one key per message, so senders never block on receivers
    (a decode instance busy in a step cannot stall a prefill instance). Each transfer has its own tag, so
    a receive abandoned after its lease expired never captures a later transfer's bytes (gloo matches on
    tags; NCCL ignores them and matches in order — there a timed-out transfer must not be re-posted)."""

    def __init__(self, store, rank: int):
        self.store, self.rank, self.next_msg = store, rank, 0

    def send(self, dst: int, msg: Message) -> None:
        i = self.store.add(f"mb/{dst}/n", 1) - 1
        self.store.set(f"mb/{dst}/{i}", pickle.dumps((self.rank, msg)))

    def poll(self) -> list[tuple[int, Message]]:
        n = self.store.add(f"mb/{self.rank}/n", 0)
        out = []
        while self.next_msg < n:
            key = f"mb/{self.rank}/{self.next_msg}"
            self.store.wait([key])  # counted but maybe not yet written: the set follows the add at once
            out.append(pickle.loads(self.store.get(key)))
            self.store.delete_key(key)
            self.next_msg += 1
        return out

    def isend_kv(self, dst: int, tag: int, tensor: torch.Tensor) -> Work:
        work = dist.isend(tensor, dst, tag=tag)
        if not tensor.is_cuda:
            # gloo reports completion only from wait(); the receive is already posted (pull protocol), so
            # this waits for the bytes alone
            work.wait()
        # NCCL: no wait. It would make this GPU's stream wait for the send, which starts only when the
        # peer's receive kernel does — after the decode step in flight there. The sender keeps the staging
        # buffer until is_completed() (an event query) says the bytes are gone.
        return work

    def irecv_kv(self, src: int, tag: int, tensor: torch.Tensor) -> Work:
        return dist.irecv(tensor, src, tag=tag)
