"""Measurement layer for disaggregated serving: what the bench and the tests read, outside the paper path.

    run_disaggregated(cfg, requests, arrivals, main=measured_instance_main)

runs the instances of nano_distserve.instance with, on top:

* a kernel warm-up (nano_vllm's layers/warmup.py, run as the engine is built) and a warm-up burst of
  the workload's first requests (`warmup_requests`), so Triton compiles stay out of every timed round;
* a step log per instance (`StepRecord`s through nano_vllm.bench.step_timing.StepTimer), each step timed as
  the instance's whole iteration — polling, admission and K/V import included, since a waiting request
  waits for them too — which the simulator's `LatencyModel.fit` is fitted to;
* the serving hand-off per request (pull sent -> blocks in the decode cache, which waits for the prefill
  side's step in flight) and, after serving, the KV transfer alone (`measure_wire`; §6.3 finds it
  insubstantial);
* where each request's TTFT went (`ttft_parts`); with `DisaggConfig.keep_kv`, the K/V each transfer sent
  and received (tests compare them bit for bit).

Results: rank 0 {"rounds", "prefill_steps", "sent"}, decode ranks {"decode_steps", "transfer_times",
"wire_times", "received"}, merged by `disagg.run_disaggregated_rounds`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nano_distserve.disagg import (
    DisaggConfig,
    build_engine,
    connect,
    serve_decode,
    serve_rounds,
    stop_decodes,
)
from nano_distserve.instance import DecodeInstance, Pending, PrefillInstance
from nano_distserve.kv_transfer import export_blocks, import_blocks
from nano_distserve.protocol import Message, Pull
from nano_vllm.bench.step_timing import StepTimer
from nano_vllm.loadgen import Request
from nano_vllm.scheduler import SchedulerOutput
from nano_vllm.sequence import Sequence

TTFT_PARTS = ("router", "queue", "messages", "forward")


@dataclass
class StepRecord:
    """One measured engine step, what `simulator.LatencyModel.fit` reads: phase token counts, the context
    its attention read, and its wall time."""

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


def measured_engine_args(engine: dict, key: str, performance_layers: bool | None = None) -> dict:
    """The engine arguments `engine` (bench.yaml's node `key`) of an engine whose steps are timed and
    fitted: `performance_layers` set when given (None: as `engine` has it), and nano_vllm's overlapped
    scheduling off. The simulator models
    a step as one serial iteration whose tokens are known when it ends, and `LatencyModel.fit` reads each
    step's wall time from its schedule to the end of its postprocess (StepTimer). Overlapped steps
    (`async_scheduling`) postprocess step t with placeholder tokens and schedule and launch step t+1
    before step t's tokens are read back, so such an interval holds parts of two steps and the fit would
    give one step's cost to its neighbour; and the disaggregated instances, which step the scheduler and
    runner themselves, never overlap. Asking for it is a ValueError naming the key."""
    if engine.get("async_scheduling"):
        raise ValueError(f"{key}.async_scheduling must be false: the simulator is fitted to serial steps, "
                         "each timed from its schedule to its postprocess, which overlapped steps interleave")
    args = {**engine, "async_scheduling": False}
    if performance_layers is not None:
        args["performance_layers"] = bool(performance_layers)
    return args


def warmup_requests(requests: list[Request], count: int = 4, max_tokens: int = 16,
                    gap_s: float = 0.02) -> tuple[list[Request], list[float]]:
    """The workload's first `count` requests, cut to `max_tokens` outputs, and their arrival times, to serve
    untimed before a measurement: two arrive together and the rest `gap_s` apart while those decode, so the
    warm-up runs the step shapes the measurement will (multi-sequence prefill, a prompt joining running
    decodes, chunk continuations, mixed and decode CUDA graphs) and Triton compiles each kernel variant
    (~1 s apiece on an H200) before the clock starts, not inside the first rate's TTFTs."""
    warm = [dataclasses.replace(r, sampling_params=dataclasses.replace(
        r.sampling_params, max_tokens=min(max_tokens, r.sampling_params.max_tokens)))
        for r in requests[:count]]
    return warm, [max(0, i - 1) * gap_s for i in range(len(warm))]


@dataclass(frozen=True)
class ResetLogs:
    """Rank 0 -> decode ranks: the warm-up is over; its steps and transfers are not data."""


class MeasuredPrefillInstance(PrefillInstance):
    """A PrefillInstance that logs its steps (`record_step` is a StepTimer callback), when each request was
    added, started its prefill iteration and its forward (`ttft_marks`), and with keep_kv what it sent."""

    def __init__(self, *args, keep_kv: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.keep_kv = keep_kv
        self.step_log: list[StepRecord] = []
        self.sent: dict[str, torch.Tensor] = {}
        self.ttft_marks: dict[str, tuple[float, float, float]] = {}  # rid -> (added, iteration, forward)
        self._added: dict[str, float] = {}
        self._iteration_start = 0.0

    def add_request(self, request_id: str, *args, **kwargs) -> None:
        self._added[request_id] = self.clock()
        super().add_request(request_id, *args, **kwargs)

    def step(self) -> None:
        self._iteration_start = time.perf_counter()
        super().step()

    def record_step(self, out: SchedulerOutput, seconds: float) -> None:
        now = time.perf_counter()
        self.step_log.append(step_record(out, now - self._iteration_start))
        for seq, sampled in zip(out.seqs, out.samples):
            if sampled and seq.request_id in self._added:  # its first token: the prompt is done
                self.ttft_marks[seq.request_id] = (self._added.pop(seq.request_id), self._iteration_start,
                                                   now - seconds)

    def _handle(self, src: int, msg: Message) -> None:
        if self.keep_kv and isinstance(msg, Pull) and msg.rid in self.handed and msg.rid in self.leases:
            self.sent[msg.rid] = export_blocks(self.runner.kv_cache, self.handed[msg.rid].block_table)
        super()._handle(src, msg)


class MeasuredDecodeInstance(DecodeInstance):
    """A DecodeInstance that logs its steps (`record_step`), each request's hand-off time (pull sent ->
    blocks in this cache) and with keep_kv what it received; `ResetLogs` clears the logs."""

    def __init__(self, *args, keep_kv: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.keep_kv = keep_kv
        self.step_log: list[StepRecord] = []
        self.transfer_times: list[float] = []  # pull sent -> bytes in the cache, seconds
        self.received: dict[str, torch.Tensor] = {}
        self._pulled_at: dict[str, float] = {}
        self._iteration_start = 0.0

    def step(self) -> None:
        self._iteration_start = time.perf_counter()
        super().step()

    def record_step(self, out: SchedulerOutput, seconds: float) -> None:
        self.step_log.append(step_record(out, time.perf_counter() - self._iteration_start))

    def _pull(self, p: Pending, seq: Sequence) -> None:
        self._pulled_at[seq.request_id] = self.clock()
        super()._pull(p, seq)

    def _start_decoding(self, rid: str, p: Pending) -> None:
        super()._start_decoding(rid, p)
        self.transfer_times.append(self.clock() - self._pulled_at.pop(rid))
        if self.keep_kv:
            self.received[rid] = export_blocks(self.runner.kv_cache, p.seq.block_table)

    def _handle(self, src: int, msg: Message) -> None:
        if isinstance(msg, ResetLogs):
            self.step_log.clear()
            self.transfer_times.clear()
        else:
            super()._handle(src, msg)


def ttft_parts(completions: list, marks: dict[str, tuple[float, float, float]], tag: str) -> dict[str, list]:
    """Where each request's TTFT went: TTFT = router (arrival -> added) + queue (added -> start of the
    iteration that prefilled it) + messages (iteration start -> its forward; polling, leases) + forward
    (-> first token). `marks` are MeasuredPrefillInstance.ttft_marks, keyed "<tag><request id>"."""
    parts: dict[str, list] = {name: [] for name in TTFT_PARTS}
    for c in completions:
        if tag + c.request_id in marks and c.token_times:
            added, it, fw = marks[tag + c.request_id]
            values = (added - c.arrival_time, it - added, fw - it, c.token_times[0] - fw)
            for name, v in zip(TTFT_PARTS, values):
                parts[name].append(v)
    return parts


def measure_wire(kv_cache: torch.Tensor, requests: list[Request], block_size: int,
                 samples: int) -> list[float]:
    """The KV transfer itself, with both sides ready (§6.3: it is insubstantial next to a decode step): for
    each of the first `samples` requests, its prompt's blocks exported, sent, received and imported into the
    peer's cache, timed from a common barrier to the receiver's synchronize. Run after serving, when every
    block is free (the copies land in blocks nobody owns). The serving log's `transfer_times` time the hand-
    off instead: pull sent -> blocks in the cache, which also waits for the prefill side's current step.
    Every rank calls it (rank 0 sends to each decode rank in turn). Returns a decode rank's times (seconds);
    rank 0 returns []."""
    rank, times = dist.get_rank(), []
    sync = torch.cuda.synchronize if kv_cache.is_cuda else (lambda: None)
    num_blocks = kv_cache.shape[2] - 1  # the last block is the runner's scratch
    for peer in range(1, dist.get_world_size()):
        for i, req in enumerate(requests[:samples]):
            ids = list(range(min(math.ceil(len(req.prompt) / block_size), num_blocks)))
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.isend(export_blocks(kv_cache, ids), peer, tag=1_000_000 + i).wait()
            elif rank == peer:
                shape = (*kv_cache.shape[:2], len(ids), *kv_cache.shape[3:])
                buf = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
                dist.irecv(buf, 0, tag=1_000_000 + i).wait()
                import_blocks(kv_cache, ids, buf)
            sync()
            if rank == peer:
                times.append(time.perf_counter() - t0)
    return times


def measured_instance_main(cfg: DisaggConfig, requests: list[Request], rounds: list[list[float]]) -> dict:
    """`disagg.instance_main` with this layer: the same instances, measured (see the module docstring).
    A warm-up burst goes through first and is left out of every log."""
    engine = build_engine(cfg)
    node = connect(cfg, engine, functools.partial(MeasuredPrefillInstance, keep_kv=cfg.keep_kv),
                   functools.partial(MeasuredDecodeInstance, keep_kv=cfg.keep_kv))
    inst = node.instance
    StepTimer(engine, on_step=inst.record_step)
    if node.router is None:
        serve_decode(inst)
        result = {"decode_steps": inst.step_log, "transfer_times": inst.transfer_times,
                  "received": {k: v for k, v in inst.received.items() if not k.startswith("warmup:")}}
    else:
        node.router.serve("warmup:", *warmup_requests(requests))
        for dst in inst.decode_ranks:
            inst.transport.send(dst, ResetLogs())
        inst.step_log.clear()
        out = serve_rounds(node.router, requests, rounds)
        for k, res in enumerate(out):
            res["ttft_parts"] = ttft_parts(res["completions"], inst.ttft_marks, f"{k}:")
        stop_decodes(inst)
        result = {"rounds": out, "prefill_steps": inst.step_log,
                  "sent": {k: v for k, v in inst.sent.items() if not k.startswith("warmup:")}}
    wire = measure_wire(engine.model_runner.kv_cache, requests, engine.config.block_size, cfg.wire_samples)
    if node.router is None:
        result["wire_times"] = wire
    dist.barrier()  # rank 0 hosts the store: it must outlive every reader
    return result
