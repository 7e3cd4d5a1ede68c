"""Prefill and decode instances (DistServe, arXiv 2401.09670, §4.3 and §5): nano_vllm's scheduler and model
runner, split by phase, joined by a pulled KV transfer (messages: nano_distserve.protocol).

* `PrefillInstance` runs nano_vllm's `Scheduler.schedule()` / `ModelRunner.execute()` / `postprocess()`
  unchanged. A request whose first token was just sampled leaves the scheduler's running queue with its
  blocks still allocated; a lease holds them until the decode side pulls them (or the lease expires).
  It tells a decode instance `Ready`; on `Pull` it copies the blocks out, sends them and frees them.
* `DecodeInstance` keeps the `Ready` requests in FIFO order and admits the head only when its blocks fit
  (§4.3: decoding instances "fetch KV cache from prefill instances as needed, using the GPU memory of
  prefill instances as a queuing buffer"), allocates them,
  sends `Pull` and posts a tagged receive. When the bytes arrive they are scattered into its own cache and
  the request joins its scheduler's running queue as an ordinary decoding sequence; nano_vllm's scheduler
  then decodes it (and would recompute it after a preemption, like any other sequence).
* Leases on both sides: the prefill side frees a request nobody pulled in `lease_ttl_s`, the decode side
  frees blocks whose bytes did not arrive in `lease_ttl_s`. A decode instance renews the prefill leases of
  requests it is holding back for memory, so backpressure is not mistaken for death.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nano_distserve.kv_message import export_kv, import_kv, kv_buffer
from nano_distserve.kv_transfer import LeaseTable
from nano_distserve.protocol import (
    Abort,
    Completion,
    Done,
    Message,
    Nack,
    Pull,
    Ready,
    Renew,
    Sent,
    Stop,
)
from nano_distserve.transport import Transport, Work
from nano_vllm.sampling_params import SamplingParams
from nano_vllm.scheduler import Scheduler, SchedulerOutput
from nano_vllm.sequence import Sequence, SequenceStatus


def completion_of(seq: Sequence) -> Completion:
    """A finished (or aborted) nano_vllm Sequence as the Completion the router keeps."""
    return Completion(seq.request_id, seq.num_prompt_tokens, seq.arrival_time, seq.output_token_ids,
                      list(seq.token_times), seq.finish_time, seq.finish_reason)


def run_step(scheduler: Scheduler, runner) -> tuple[SchedulerOutput, list[Sequence]]:
    """One nano_vllm iteration of this instance's phase: schedule, forward + sample, postprocess."""
    out = scheduler.schedule()
    if not out.seqs:  # e.g. every free block is held for a transfer
        return out, []
    finished = scheduler.postprocess(out, runner.execute(out))
    for seq in finished:
        runner.release(seq)
    return out, finished


class PrefillInstance:
    """Prefill-only serving over a nano_vllm Scheduler and ModelRunner; hands requests to decode ranks."""

    def __init__(self, scheduler: Scheduler, runner, transport: Transport, decode_ranks: list[int],
                 lease_ttl_s: float = 10.0, clock: Callable[[], float] = time.perf_counter):
        self.scheduler, self.runner, self.transport = scheduler, runner, transport
        self.decode_ranks = decode_ranks
        self.lease_ttl_s, self.clock = lease_ttl_s, clock
        self.leases = LeaseTable(clock)
        self.handed: dict[str, Sequence] = {}  # prefilled, blocks under lease, waiting for a pull
        # staging buffers until their send completes
        self.sending: list[tuple[Work, torch.Tensor]] = []
        # rid -> how it ended (finished here, or reported by a decode instance). The first report wins: a
        # pull that arrives after the lease expired is nacked, and the decode side reports it once more.
        self.completed: dict[str, Completion] = {}
        self._next_decode = 0

    def add_request(self, request_id: str, prompt: list[int], sp: SamplingParams,
                    arrival_time: float) -> None:
        self.scheduler.add(Sequence(prompt, sp, request_id, arrival_time))

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.handed) or bool(self.sending)

    def abort(self, request_id: str) -> None:
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            self.runner.release(seq)
            self._complete(completion_of(seq))
        if self.leases.take(request_id):
            self._free(request_id, "abort")
        for dst in self.decode_ranks:
            self.transport.send(dst, Abort(request_id))

    def step(self) -> None:
        for src, msg in self.transport.poll():
            self._handle(src, msg)
        self.leases.expire()  # nobody pulled in time: the decode side is gone or stuck
        self.sending = [(w, buf) for w, buf in self.sending if not w.is_completed()]
        if not self.scheduler.has_unfinished():
            return
        out, finished = run_step(self.scheduler, self.runner)
        for seq in finished:  # EOS or max_tokens reached at the first token
            self._complete(completion_of(seq))
        for seq, sampled in zip(out.seqs, out.samples):
            # not a prompt chunk short of the last
            if sampled and seq.status is SequenceStatus.RUNNING:
                self._hand_off(seq)

    def _complete(self, c: Completion) -> None:
        self.completed.setdefault(c.request_id, c)

    def _free(self, request_id: str, reason: str | None = None) -> None:
        seq = self.handed.pop(request_id)
        self.scheduler.block_manager.free(seq)
        self.runner.release(seq)
        if reason is not None:  # the request ends here, unfinished
            seq.finish_reason, seq.finish_time = reason, self.clock()
            self._complete(completion_of(seq))

    def _hand_off(self, seq: Sequence) -> None:
        """The prompt is done: keep its blocks under a lease and tell a decode instance it can pull."""
        self.scheduler.running.remove(seq)
        rid = seq.request_id
        self.handed[rid] = seq
        self.leases.grant(rid, self.lease_ttl_s, lambda: self._free(rid, "transfer_timeout"))
        dst = self.decode_ranks[self._next_decode % len(self.decode_ranks)]
        self._next_decode += 1
        self.transport.send(dst, Ready(rid, seq.prompt_token_ids, seq.token_ids[-1],
                                       seq.token_times[0], seq.arrival_time, seq.sampling_params,
                                       len(seq.block_table)))

    def _send_blocks(self, dst: int, rid: str, tag: int) -> None:
        """Answer a pull: the blocks as one staging copy, sent asynchronously, then freed."""
        seq = self.handed[rid]
        buf = export_kv(self.runner, seq.block_table, seq.num_prompt_tokens)
        # The staging copy is the message, so the blocks are free for new prompts right away. The decode
        # side posts its receive right after asking; `Sent` tells it the bytes are on their way (gloo
        # works report completion only from wait()).
        self.sending.append((self.transport.isend_kv(dst, tag, buf), buf))
        self._free(rid)
        self.transport.send(dst, Sent(rid))

    def _handle(self, src: int, msg: Message) -> None:
        match msg:
            case Pull(rid, tag):
                if rid in self.handed and self.leases.take(rid):
                    self._send_blocks(src, rid, tag)
                else:
                    self.transport.send(src, Nack(rid))  # expired or aborted
            case Renew(rids):
                for rid in rids:
                    self.leases.renew(rid, self.lease_ttl_s)
            case Done(completion):
                self._complete(completion)
            case Abort(rid):
                self.abort(rid)
            case _:
                raise ValueError(f"prefill instance got an unexpected message {msg!r}")


@dataclass
class Pending:
    """A Ready request on the decode side: queued, then (once admitted) allocated and receiving."""

    ready: Ready
    src: int
    seq: Sequence | None = None
    buf: torch.Tensor | None = None
    work: Work | None = None
    arrived: bool = False
    renewed_at: float = float("-inf")


class DecodeInstance:
    """Decode-only serving: pulls prefilled requests when their blocks fit, then decodes them with
    nano_vllm."""

    def __init__(self, scheduler: Scheduler, runner, transport: Transport, router_rank: int = 0,
                 lease_ttl_s: float = 10.0, clock: Callable[[], float] = time.perf_counter,
                 watermark_blocks: int = 1):
        self.scheduler, self.runner, self.transport = scheduler, runner, transport
        self.router_rank, self.lease_ttl_s, self.clock = router_rank, lease_ttl_s, clock
        # room kept for running requests' next decode blocks
        self.watermark_blocks = watermark_blocks
        self.leases = LeaseTable(clock)
        self.queue: OrderedDict[str, Pending] = OrderedDict()  # Ready, in arrival order
        self.stopped = False
        self._tags = 0

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.queue)

    def step(self) -> None:
        for src, msg in self.transport.poll():
            self._handle(src, msg)
        self.leases.expire()
        self._admit()
        for rid, p in list(self.queue.items()):
            if p.arrived and self.leases.take(rid):
                self._start_decoding(rid, p)
        self._renew()
        if self.scheduler.has_unfinished():
            _, finished = run_step(self.scheduler, self.runner)
            for seq in finished:
                self._report(completion_of(seq))

    def _report(self, c: Completion) -> None:
        self.transport.send(self.router_rank, Done(c))

    def _fail(self, rid: str, reason: str) -> None:
        p = self.queue.pop(rid, None)
        if p is not None:
            m = p.ready
            self._report(Completion(rid, len(m.prompt), m.arrival_time, [m.first_token],
                                    [m.first_token_time], self.clock(), reason))

    def _admit(self) -> None:
        """Backpressure: pull the oldest ready request only when all its blocks fit (plus a watermark)."""
        bm = self.scheduler.block_manager
        for rid, p in self.queue.items():
            if p.seq is not None:
                continue
            m = p.ready
            if m.num_blocks + self.watermark_blocks > bm.num_free_blocks:
                return  # FCFS: later requests wait behind it
            seq = Sequence(m.prompt, m.sampling_params, rid, m.arrival_time)
            if not bm.allocate_slots(seq, len(m.prompt), (), num_computed_tokens=0):
                return
            seq.append_token(m.first_token, m.first_token_time)
            self._pull(p, seq)

    def _pull(self, p: Pending, seq: Sequence) -> None:
        """Ask for the blocks of `seq`, now allocated here, and post their receive."""
        self._tags += 1  # unique per (prefill, decode) pair, which is all gloo's tag matching needs
        p.seq = seq
        p.buf = kv_buffer(self.runner, len(seq.block_table))  # (a KIVI cache's: with its residual)
        rid = seq.request_id
        self.leases.grant(rid, self.lease_ttl_s, lambda: self._drop(rid, seq, "transfer_timeout"))
        # Ask first, then post the receive: NCCL's first send/recv between two ranks sets up their
        # connection and blocks until the peer makes its matching call, which the prefill side does
        # only once it has this message (receive first deadlocked on the H200s; gloo never blocks here).
        self.transport.send(p.src, Pull(rid, self._tags))
        p.work = self.transport.irecv_kv(p.src, self._tags, p.buf)

    def _start_decoding(self, rid: str, p: Pending) -> None:
        """The bytes arrived: scatter them into this cache; the request joins the running queue."""
        p.work.wait()
        import_kv(self.runner, p.seq.block_table, p.buf, p.seq.num_prompt_tokens, p.seq)
        del self.queue[rid]
        p.seq.num_computed_tokens = p.seq.num_prompt_tokens
        p.seq.status = SequenceStatus.RUNNING
        # The newest Sequence has the largest seq_id, so `running` stays sorted by arrival. The first
        # token's stop rules (EOS, max_tokens) were applied by the prefill instance's scheduler.
        self.scheduler.running.append(p.seq)

    def _drop(self, rid: str, seq: Sequence, reason: str) -> None:
        self.scheduler.block_manager.free(seq)
        self._fail(rid, reason)

    def _renew(self) -> None:
        """Keep the prefill leases of requests held back by backpressure alive (they are not lost)."""
        now = self.clock()
        by_src: dict[int, list[str]] = {}
        for rid, p in self.queue.items():
            if p.seq is None and now - p.renewed_at > self.lease_ttl_s / 4:
                p.renewed_at = now
                by_src.setdefault(p.src, []).append(rid)
        for src, rids in by_src.items():
            self.transport.send(src, Renew(rids))

    def _handle(self, src: int, msg: Message) -> None:
        match msg:
            case Ready(rid=rid):
                self.queue[rid] = Pending(msg, src)
            case Sent(rid):
                p = self.queue.get(rid)
                if p is not None and p.seq is not None:
                    p.arrived = True
            # the prefill side no longer has it (its lease expired, or it was aborted)
            case Nack(rid):
                if not self.leases.release(rid):
                    self._fail(rid, "transfer_timeout")
            case Abort(rid):
                self._abort(rid)
            case Stop():
                self.stopped = True
            case _:
                raise ValueError(f"decode instance got an unexpected message {msg!r}")

    def _abort(self, rid: str) -> None:
        p = self.queue.get(rid)
        if p is not None and p.seq is not None and self.leases.take(rid):
            self._drop(rid, p.seq, "abort")
        elif p is not None:
            self._fail(rid, "abort")
        else:
            seq = self.scheduler.abort(rid)
            if seq is not None:
                self.runner.release(seq)
                self._report(completion_of(seq))
