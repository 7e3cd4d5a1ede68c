"""What nano_megatron's bench measures besides the step time: the pipeline bubble (a timed schedule) and,
on GPUs, how much of a step the GPU was busy (the profiler's device activity), with optional listings of
the top kernels and of the host ops the GPU sat idle in (`top_kernels=N`, `idle_ops=N`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from nano_megatron.pipeline_parallel import PipelineSchedule
from nano_megatron.schedules import Action


class TimedPipelineSchedule(PipelineSchedule):
    """`PipelineSchedule` that appends (action, start, end) marks of each compute action to `timeline`
    (CUDA events on GPUs, perf_counter seconds elsewhere), after its receive completed: the busy time the
    bench turns into a measured bubble."""

    timeline: ClassVar[list[tuple[Action, Any, Any]]] = []  # `timed_schedule` gives each class its own

    def _mark(self) -> Any:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def forward_step(self, a: Action, received: torch.Tensor | None) -> list[dist.P2POp]:
        start = self._mark()
        sends = super().forward_step(a, received)
        self.timeline.append((a, start, self._mark()))
        return sends

    def backward_step(self, a: Action, received: torch.Tensor | None) -> list[dist.P2POp]:
        start = self._mark()
        sends = super().backward_step(a, received)
        self.timeline.append((a, start, self._mark()))
        return sends


def timed_schedule(timeline: list) -> type[TimedPipelineSchedule]:
    """A TimedPipelineSchedule class recording into `timeline` (set it as an engine's `pipeline_schedule`)."""
    return type("TimedPipelineSchedule", (TimedPipelineSchedule,), {"timeline": timeline})


def busy_seconds(timeline: list[tuple[Action, Any, Any]]) -> float:
    """Total compute time of a timed schedule's timeline (synchronises CUDA first)."""
    total = 0.0
    for _, start, end in timeline:
        if isinstance(start, torch.cuda.Event):
            end.synchronize()
            total += start.elapsed_time(end) / 1e3
        else:
            total += end - start
    return total


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of (start, end) intervals (overlapping kernels on two streams count once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def device_activity_seconds(fn: Callable[[], Any], device: str | torch.device,
                            top_kernels: int = 0, idle_ops: int = 0) -> dict[str, float] | None:
    """Seconds during one call of `fn` in which the GPU ran something, from the profiler's device activity:
    {"busy": any kernel or copy (any stream), "nccl": NCCL kernels, "other": everything but NCCL}, each the
    union of its spans; None off CUDA. Beside the call's unprofiled wall time, "busy" tells whether the host
    keeps the GPU fed (busy ≈ wall) or the GPU waits for Python and launches (busy << wall); a synchronous
    collective's kernel runs while it waits for the peer, so "nccl" far above bytes / bandwidth means ranks
    waiting on each other. `top_kernels` > 0 also prints that many kernels by total device time (name,
    calls, total ms): where the device time goes. `idle_ops` > 0 also records the host's ops and prints
    that many host ops by the GPU idle time spent inside them (the innermost op running when the GPU went
    idle): what the GPU waits for (host profiling slows the host, so read it as a ranking)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(dev)
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if idle_ops > 0 else [])
    with profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize(dev)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    nccl = [(e.time_range.start, e.time_range.end) for e in events if "nccl" in e.name.lower()]
    other = [(e.time_range.start, e.time_range.end) for e in events if "nccl" not in e.name.lower()]
    if top_kernels > 0:
        print_top_kernels(events, top_kernels)
    if idle_ops > 0:
        print_idle_ops(events, [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU],
                       idle_ops)
    # the profiler's clock is in microseconds
    return {"busy": union_seconds(nccl + other) / 1e6, "nccl": union_seconds(nccl) / 1e6,
            "other": union_seconds(other) / 1e6}


def print_top_kernels(gpu_events: list, top: int) -> None:
    """The `top` kernels by total device time: total ms, calls, name."""
    totals: dict[str, list[float]] = {}
    for e in gpu_events:
        t = totals.setdefault(e.name, [0, 0.0])
        t[0] += 1
        t[1] += (e.time_range.end - e.time_range.start) / 1e3
    for name, (calls, ms) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {ms:9.2f} ms {calls:6d} calls  {name[:110]}", flush=True)


def print_idle_ops(gpu_events: list, cpu_events: list, top: int, min_gap_us: float = 20.0) -> None:
    """Gaps between the GPU's activity spans, each charged to the innermost host op that contains the
    gap's start (host ops nest by time on one thread); prints the `top` ops by idle time they cover."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in gpu_events)
    gaps, end = [], None
    for a, b in spans:
        if end is not None and a - end > min_gap_us:
            gaps.append((end, a))
        end = b if end is None else max(end, b)
    host = sorted(((e.time_range.start, e.time_range.end, e.name) for e in cpu_events), key=lambda t: (t[0], -t[1]))
    totals: dict[str, list[float]] = {}
    for g0, g1 in gaps:
        inner = None
        for a, b, name in host:  # few thousand ops per step: a scan per gap is fast enough
            if a > g0:
                break
            if b >= g0 and (inner is None or b - a <= inner[1] - inner[0]):
                inner = (a, b, name)
        t = totals.setdefault(inner[2] if inner else "(no host op)", [0, 0.0])
        t[0] += 1
        t[1] += (g1 - g0) / 1e3
    idle = sum(g1 - g0 for g0, g1 in gaps) / 1e3
    print(f"  GPU idle {idle:.2f} ms in {len(gaps)} gaps > {min_gap_us:.0f} us; by innermost host op:", flush=True)
    for name, (n, ms) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {ms:9.2f} ms {n:6d} gaps  {name[:110]}", flush=True)
