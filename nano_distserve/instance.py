"""Prefill and decode instances (DistServe, arXiv 2401.09670, §4 and §5): nano_vllm's scheduler and model
runner, split by phase, joined by a pulled KV transfer.

* `PrefillInstance` runs nano_vllm's `Scheduler.schedule()` / `ModelRunner.execute()` / `postprocess()`
  unchanged. A request whose first token was just sampled leaves the scheduler's running queue with its
  blocks still allocated; a lease holds them until the decode side pulls them (or the lease expires).
  It tells a decode instance `ready`; on `pull` it copies the blocks out, sends them and frees them.
* `DecodeInstance` keeps the `ready` requests in FIFO order and admits the head only when its blocks fit
  (backpressure, §4.4: "the decoding instance fetches the KV cache when it has room"), allocates them,
  posts a tagged receive and sends `pull`. When the bytes arrive they are scattered into its own cache and
  the request joins its scheduler's running queue as an ordinary decoding sequence; nano_vllm's scheduler
  then decodes it (and would recompute it after a preemption, like any other sequence).
* Leases on both sides: the prefill side frees a request nobody pulled in `lease_ttl_s`, the decode side
  frees blocks whose bytes did not arrive in `lease_ttl_s`. A decode instance renews the prefill leases of
  requests it is holding back for memory, so backpressure is not mistaken for death.

Messages (dicts): ready / pull / nack / renew / abort / finished / failed; see `_handle` of each class.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nano_distserve.kv_transfer import LeaseTable, Transport, Work, export_blocks, import_blocks
from nano_vllm.sampling_params import SamplingParams
from nano_vllm.scheduler import Scheduler, SchedulerOutput
from nano_vllm.sequence import Sequence, SequenceStatus


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


@dataclass
class StepRecord:
    """One engine step, for the simulator's latency fit: phase token counts and the context it read."""

    prefill_tokens: int
    decode_seqs: int
    context_tokens: int
    seconds: float


def step_record(out: SchedulerOutput, seconds: float) -> StepRecord:
    """The record of a step, taken after its postprocess (which advanced each sequence's computed tokens
    by its chunk: what the step's attention read, its own tokens included)."""
    pre = sum(n for n in out.num_new_tokens if n > 1)
    dec = sum(1 for n in out.num_new_tokens if n == 1)
    ctx = sum(s.num_computed_tokens for s in out.seqs)
    return StepRecord(pre, dec, ctx, seconds)


def _completion(seq: Sequence) -> Completion:
    return Completion(seq.request_id, seq.num_prompt_tokens, seq.arrival_time, seq.output_token_ids,
                      list(seq.token_times), seq.finish_time or time.perf_counter(), seq.finish_reason)


def _execute(scheduler: Scheduler, runner, log: list[StepRecord],
             t_start: float | None = None) -> tuple[SchedulerOutput, list[Sequence]]:
    """One nano_vllm step (schedule, forward + sample, postprocess), logged with its wall time from
    `t_start` (default: the schedule call) to the end of postprocess. An instance passes the start of its
    whole iteration, so the time it spends polling, admitting and importing K/V between forwards is in the
    step time its simulator model is fitted to: requests wait for it too (their TPOT counts it)."""
    t0 = time.perf_counter() if t_start is None else t_start
    out = scheduler.schedule()
    if not out.seqs:
        return out, []
    tokens = runner.execute(out)
    finished = scheduler.postprocess(out, tokens)
    for seq in finished:
        runner.release(seq)
    log.append(step_record(out, time.perf_counter() - t0))
    return out, finished


class PrefillInstance:
    """Prefill-only serving over a nano_vllm Scheduler and ModelRunner; hands requests to decode ranks."""

    def __init__(self, scheduler: Scheduler, runner, transport: Transport, decode_ranks: list[int],
                 lease_ttl_s: float = 10.0, clock: Callable[[], float] = time.perf_counter,
                 keep_sent: bool = False, keep_ttft_parts: bool = False):
        self.scheduler, self.runner, self.transport = scheduler, runner, transport
        self.decode_ranks = decode_ranks
        self.lease_ttl_s, self.clock = lease_ttl_s, clock
        self.leases = LeaseTable(clock)
        self.handed: dict[str, Sequence] = {}  # prefilled, blocks under lease, waiting for a pull
        self.sending: list[tuple[Work, torch.Tensor]] = []  # staging buffers until their send completes
        # rid -> how it ended (finished here, or reported by a decode instance). The first report wins: a
        # pull that arrives after the lease expired is nacked, and the decode side reports it once more.
        self.completed: dict[str, Completion] = {}
        self.sent: dict[str, torch.Tensor] = {}  # with keep_sent: what each transfer carried (tests)
        self.keep_sent = keep_sent
        self.step_log: list[StepRecord] = []
        self._next_decode = 0
        # with keep_ttft_parts, rid -> (added, start of the iteration that prefilled it, start of that
        # iteration's forward): where a request's TTFT goes besides its forward (bench diagnostics)
        self.ttft_parts: dict[str, tuple[float, float, float]] = {}
        self.keep_ttft_parts = keep_ttft_parts
        self._added: dict[str, float] = {}

    def add_request(self, request_id: str, prompt: list[int], sp: SamplingParams, arrival_time: float) -> None:
        if self.keep_ttft_parts:
            self._added[request_id] = self.clock()
        self.scheduler.add(Sequence(prompt, sp, request_id, arrival_time))

    def _complete(self, c: Completion) -> None:
        self.completed.setdefault(c.request_id, c)

    def abort(self, request_id: str) -> None:
        self._added.pop(request_id, None)
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            self.runner.release(seq)
            self._complete(_completion(seq))
        if self.leases.take(request_id):
            self._free(request_id, "abort")
        for dst in self.decode_ranks:
            self.transport.send(dst, {"type": "abort", "rid": request_id})

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.handed) or bool(self.sending)

    def _free(self, request_id: str, reason: str | None = None) -> None:
        seq = self.handed.pop(request_id)
        self.scheduler.block_manager.free(seq)
        self.runner.release(seq)
        if reason is not None:  # the request ends here, unfinished
            seq.finish_reason, seq.finish_time = reason, self.clock()
            self._complete(_completion(seq))

    def step(self) -> None:
        t_start = time.perf_counter()
        for msg in self.transport.poll():
            self._handle(msg)
        self.leases.expire()  # nobody pulled in time: the decode side is gone or stuck
        self.sending = [(w, buf) for w, buf in self.sending if not w.is_completed()]
        if not self.scheduler.has_unfinished():
            return
        t_forward = time.perf_counter()
        out, finished = _execute(self.scheduler, self.runner, self.step_log, t_start)
        for seq in finished:  # EOS or max_tokens reached at the first token
            self._complete(_completion(seq))
        for seq, sampled in zip(out.seqs, out.samples):
            if not sampled:  # a prompt chunk that is not the last
                continue
            if seq.request_id in self._added:
                self.ttft_parts[seq.request_id] = (self._added.pop(seq.request_id), t_start, t_forward)
            if seq.status is SequenceStatus.RUNNING:
                self._hand_off(seq)

    def _hand_off(self, seq: Sequence) -> None:
        """The prompt is done: keep its blocks under a lease and tell a decode instance it can pull."""
        self.scheduler.running.remove(seq)
        rid = seq.request_id
        self.handed[rid] = seq
        self.leases.grant(rid, self.lease_ttl_s, lambda: self._free(rid, "transfer_timeout"))
        dst = self.decode_ranks[self._next_decode % len(self.decode_ranks)]
        self._next_decode += 1
        self.transport.send(dst, {"type": "ready", "rid": rid, "prompt": seq.prompt_token_ids,
                                  "first_token": seq.token_ids[-1], "first_token_time": seq.token_times[0],
                                  "arrival_time": seq.arrival_time, "sp": seq.sampling_params,
                                  "num_blocks": len(seq.block_table)})

    def _handle(self, msg: dict) -> None:
        kind, rid = msg["type"], msg.get("rid")
        if kind == "pull":
            if rid not in self.handed or not self.leases.take(rid):
                self.transport.send(msg["src"], {"type": "nack", "rid": rid})  # expired or aborted
                return
            seq = self.handed[rid]
            buf = export_blocks(self.runner.kv_cache, seq.block_table)
            if self.keep_sent:
                self.sent[rid] = buf.clone()
            # The staging copy is the message, so the blocks are free for new prompts right away. The
            # send is asynchronous (the decode side posts its receive right after asking); `sent` then
            # tells it the bytes are on their way (gloo works only report completion from wait()).
            self.sending.append((self.transport.isend_kv(msg["src"], msg["tag"], buf), buf))
            self._free(rid)
            self.transport.send(msg["src"], {"type": "sent", "rid": rid})
        elif kind == "renew":
            for r in msg["rids"]:
                self.leases.renew(r, self.lease_ttl_s)
        elif kind in ("finished", "failed"):
            self._complete(msg["completion"])
        elif kind == "abort":
            self.abort(rid)
        else:
            raise ValueError(f"prefill instance got an unknown message {kind!r}")


@dataclass
class _Pending:
    msg: dict
    seq: Sequence | None = None  # allocated, receiving
    pulled_at: float = 0.0
    arrived: bool = False
    buf: torch.Tensor | None = None
    work: Work | None = None
    renewed_at: float = field(default=-1e30)


class DecodeInstance:
    """Decode-only serving: pulls prefilled requests when their blocks fit, then decodes them with nano_vllm."""

    def __init__(self, scheduler: Scheduler, runner, transport: Transport, router_rank: int = 0,
                 lease_ttl_s: float = 10.0, clock: Callable[[], float] = time.perf_counter,
                 keep_received: bool = False, watermark_blocks: int = 1):
        self.scheduler, self.runner, self.transport = scheduler, runner, transport
        self.router_rank, self.lease_ttl_s, self.clock = router_rank, lease_ttl_s, clock
        self.watermark_blocks = watermark_blocks  # room kept for running requests' next decode blocks
        self.leases = LeaseTable(clock)
        self.queue: OrderedDict[str, _Pending] = OrderedDict()  # ready, in arrival order
        self.received: dict[str, torch.Tensor] = {}
        self.keep_received = keep_received
        self.step_log: list[StepRecord] = []
        self.transfer_times: list[float] = []  # pull sent -> bytes in the cache, seconds
        self.stopped = False
        self._tags = 0

    @property
    def block_manager(self):
        return self.scheduler.block_manager

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.queue)

    def step(self) -> None:
        t_start = time.perf_counter()
        for msg in self.transport.poll():
            self._handle(msg)
        self.leases.expire()
        self._admit()
        self._receive()
        self._renew()
        if self.scheduler.has_unfinished():
            _, finished = _execute(self.scheduler, self.runner, self.step_log, t_start)
            for seq in finished:
                self._report("finished", _completion(seq))

    def _report(self, kind: str, c: Completion) -> None:
        self.transport.send(self.router_rank, {"type": kind, "rid": c.request_id, "completion": c})

    def _fail(self, rid: str, reason: str) -> None:
        p = self.queue.pop(rid, None)
        if p is not None:
            m = p.msg
            self._report("failed", Completion(rid, len(m["prompt"]), m["arrival_time"], [m["first_token"]],
                                              [m["first_token_time"]], self.clock(), reason))

    def _admit(self) -> None:
        """Backpressure: pull the oldest ready request only when all its blocks fit (plus a watermark)."""
        bm = self.block_manager
        for rid, p in self.queue.items():
            if p.seq is not None:
                continue
            m = p.msg
            if m["num_blocks"] + self.watermark_blocks > bm.num_free_blocks:
                return  # FCFS: later requests wait behind it
            seq = Sequence(m["prompt"], m["sp"], rid, m["arrival_time"])
            if not bm.allocate_slots(seq, len(m["prompt"]), (), num_computed_tokens=0):
                return
            seq.append_token(m["first_token"], m["first_token_time"])
            self._tags += 1  # unique per (prefill, decode) pair, which is all gloo's tag matching needs
            tag = self._tags
            p.seq = seq
            cache = self.runner.kv_cache
            shape = (*cache.shape[:2], len(seq.block_table), *cache.shape[3:])
            p.buf = torch.empty(shape, dtype=cache.dtype, device=cache.device)
            p.pulled_at = self.clock()
            self.leases.grant(rid, self.lease_ttl_s, lambda r=rid, s=seq: self._drop(r, s, "transfer_timeout"))
            # Ask first, then post the receive: NCCL's first send/recv between two ranks sets up their
            # connection and blocks until the peer makes its matching call, which the prefill side does
            # only once it has this message (receive first deadlocked on the H200s; gloo never blocks here).
            self.transport.send(m["src"], {"type": "pull", "rid": rid, "tag": tag})
            p.work = self.transport.irecv_kv(m["src"], tag, p.buf)

    def _drop(self, rid: str, seq: Sequence, reason: str) -> None:
        bm = self.block_manager
        bm.free(seq)
        self._fail(rid, reason)

    def _receive(self) -> None:
        for rid, p in list(self.queue.items()):
            if not p.arrived or not self.leases.take(rid):
                continue
            p.work.wait()
            seq = p.seq
            import_blocks(self.runner.kv_cache, seq.block_table, p.buf)
            if self.keep_received:
                self.received[rid] = export_blocks(self.runner.kv_cache, seq.block_table)
            del self.queue[rid]
            self.transfer_times.append(self.clock() - p.pulled_at)
            seq.num_computed_tokens = seq.num_prompt_tokens
            seq.status = SequenceStatus.RUNNING
            # The newest Sequence has the largest seq_id, so `running` stays sorted by arrival. The first
            # token's stop rules (EOS, max_tokens) were applied by the prefill instance's scheduler.
            self.scheduler.running.append(seq)

    def _renew(self) -> None:
        """Keep the prefill leases of requests held back by backpressure alive (they are not lost)."""
        now = self.clock()
        by_src: dict[int, list[str]] = {}
        for rid, p in self.queue.items():
            if p.seq is None and now - p.renewed_at > self.lease_ttl_s / 4:
                p.renewed_at = now
                by_src.setdefault(p.msg["src"], []).append(rid)
        for src, rids in by_src.items():
            self.transport.send(src, {"type": "renew", "rids": rids})

    def _handle(self, msg: dict) -> None:
        kind, rid = msg["type"], msg.get("rid")
        if kind == "ready":
            self.queue[rid] = _Pending(msg)
        elif kind == "stop":
            self.stopped = True
        elif kind == "reset_logs":  # the router's warm-up is over: its first transfer and steps are not data
            self.transfer_times.clear()
            self.step_log.clear()
        elif kind == "sent":
            p = self.queue.get(rid)
            if p is not None and p.seq is not None:
                p.arrived = True
        elif kind == "nack":  # the prefill side no longer has it (its lease expired, or it was aborted)
            if not self.leases.release(rid):
                self._fail(rid, "transfer_timeout")
        elif kind == "abort":
            p = self.queue.get(rid)
            if p is not None and p.seq is not None and self.leases.take(rid):
                self._drop(rid, p.seq, "abort")
            elif p is not None:
                self._fail(rid, "abort")
            else:
                seq = self.scheduler.abort(rid)
                if seq is not None:
                    self.runner.release(seq)
                    self._report("finished", _completion(seq))
        else:
            raise ValueError(f"decode instance got an unknown message {kind!r}")
