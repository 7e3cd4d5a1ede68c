"""Step timing — a measurement hook: where each engine step's wall time goes, and a callback per step.

    timer = StepTimer(engine, on_step=lambda out, seconds: ...)   # installs itself
    ...                                                           # step the engine (generate, serve, ...)
    timer.seconds, timer.num_steps, timer.num_eager_steps, timer.per_step_ms()
    timer.remove()

The paper path carries no timing code: the timer wraps, on these instances only, the methods one step
calls — `scheduler.schedule`, `model_runner.execute` (which calls `model_runner.prepare`, also timed),
`scheduler.postprocess` — and counts `model_runner.forward` calls (steps that replayed no CUDA graph). It
times whoever drives those parts: `LLMEngine.step`, or nano_distserve's instances, which step the
scheduler and runner themselves.

Phases, summed over steps in `seconds`: "schedule"; "execute", the runner's whole call — input
preparation on the host, launches, then the wait for the sampled tokens; "postprocess"; "prepare" (inside
"execute": host time the GPU may sit idle for). A schedule that finds nothing to run is not a step.
(Overlapped steps, nano_vllm.layers.overlap, launch through `prepare` / `run` / `sample` and wait elsewhere:
their "execute" stays 0, and the timeline below says where the time goes.)

`StepTimer(engine, timeline=True)` also keeps a `StepTimeline`: every host interval of the phases above
(and of the runner's `run` and `sample`, the launches) and, per step, when the device started and finished
its work (CUDA events recorded as `run` starts and after `sample`; on a CPU, the host intervals of those
calls). `timeline.summary()` gives host busy, device busy and device idle time per step;
`timeline.window(n)` the intervals of n consecutive steps, for a figure (shared.report).
The start event is recorded as `run` is entered, before the runner's own host work in it (a CUDA graph's
input staging): when the host is late the device waits there, and that wait counts as busy. So a
host-bound step's idle is understated: at batch 1 on qwen3-0.6b (H200, 2026-12-07) this said 0.01 ms idle
a step, while the step's kernels and copies took about 0.65 ms of its 0.70 and the host's step 0.67
(`docs/results/nano_vllm_batch1_step_overheads.json`); the kernel profile (`profile_steps`) shows the
bubbles, enlarged by the profiler's own cost per launch.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import torch

from nano_vllm.engine import LLMEngine
from nano_vllm.scheduler import SchedulerOutput

PHASES = ("schedule", "execute", "postprocess", "prepare")


class StepTimer:
    """Installed on one engine by its constructor; `on_step(out, seconds)` is called after each step with
    the SchedulerOutput and the step's wall time from the start of its schedule to the end of its
    postprocess."""

    def __init__(self, engine: LLMEngine, on_step: Callable[[SchedulerOutput, float], None] | None = None,
                 timeline: bool = False):
        self.on_step = on_step
        self.timeline = StepTimeline(engine.model_runner.device) if timeline else None
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.num_steps = 0
        self.num_eager_steps = 0
        self._step_start = 0.0
        sched, runner = engine.scheduler, engine.model_runner
        # (instance, method name, what the instance itself held under that name: another wrapper, or None)
        self._installed: list[tuple[Any, str, Any]] = []
        wrappers = [(sched, "schedule", self._schedule), (runner, "prepare", self._timed("prepare")),
                    (runner, "execute", self._timed("execute")), (sched, "postprocess", self._postprocess),
                    (runner, "forward", self._forward)]
        if self.timeline is not None:
            wrappers += [(runner, "run", self.timeline.wrap_run), (runner, "sample", self.timeline.wrap_sample)]
        for obj, name, wrapper in wrappers:
            self._installed.append((obj, name, vars(obj).get(name)))
            setattr(obj, name, _bind(wrapper, getattr(obj, name)))

    def remove(self) -> None:
        """Uninstall: the instances' methods are what they were before."""
        for obj, name, own in reversed(self._installed):
            if own is not None:
                setattr(obj, name, own)
            else:
                delattr(obj, name)
        self._installed = []

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.num_steps = self.num_eager_steps = 0
        if self.timeline is not None:
            self.timeline = StepTimeline(self.timeline.device)

    @property
    def step_seconds(self) -> float:
        """Wall seconds of all steps: schedule + execute + postprocess."""
        return self.seconds["schedule"] + self.seconds["execute"] + self.seconds["postprocess"]

    def per_step_ms(self) -> dict[str, float]:
        """Milliseconds per step of each phase."""
        return {k: 1e3 * v / max(self.num_steps, 1) for k, v in self.seconds.items()}

    # ------------------------------------------------------------------ wrappers
    def _schedule(self, schedule: Callable[..., SchedulerOutput], *args: Any,
                  **kwargs: Any) -> SchedulerOutput:
        t0 = time.perf_counter()
        out = schedule(*args, **kwargs)
        if out.seqs:
            t1 = time.perf_counter()
            self.seconds["schedule"] += t1 - t0
            self._step_start = t0
            if self.timeline is not None:
                self.timeline.host.append(("schedule", t0, t1))
        return out

    def _timed(self, phase: str) -> Callable[..., Any]:
        def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                self.seconds[phase] += t1 - t0
                if self.timeline is not None and phase == "prepare":
                    self.timeline.host.append((phase, t0, t1))
        return timed

    def _postprocess(self, postprocess: Callable[..., Any], out: SchedulerOutput, *args: Any,
                     **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        finished = postprocess(out, *args, **kwargs)
        t1 = time.perf_counter()
        self.seconds["postprocess"] += t1 - t0
        self.num_steps += 1
        if self.timeline is not None:
            self.timeline.host.append(("postprocess", t0, t1))
        if self.on_step is not None:
            self.on_step(out, t1 - self._step_start)
        return finished

    def _forward(self, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.num_eager_steps += 1
        return forward(*args, **kwargs)


class StepTimeline:
    """Host intervals (phase, start, end) and device intervals (start, end) of the steps a StepTimer sees, in
    `time.perf_counter` seconds. Device times come from CUDA events, placed on the host clock by one event
    recorded at construction; `summary` and `window` read them (one synchronize)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.host: list[tuple[str, float, float]] = []
        self._events: list[list[Any]] = []  # per step: [start, end], CUDA events or host times
        self._cuda = device.type == "cuda"
        self._origin: tuple[float, Any] | None = None
        if self._cuda:
            torch.cuda.synchronize(device)
            origin = torch.cuda.Event(enable_timing=True)
            origin.record()
            self._origin = (time.perf_counter(), origin)

    def _mark(self) -> Any:
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def wrap_run(self, run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The runner's `run`: the device's work for a step starts here."""
        t0 = time.perf_counter()
        step = [self._mark(), None]
        self._events.append(step)
        try:
            return run(*args, **kwargs)
        finally:
            step[1] = self._mark()
            self.host.append(("launch", t0, time.perf_counter()))

    def wrap_sample(self, sample: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The runner's `sample`: the step's device work ends with it."""
        t0 = time.perf_counter()
        try:
            return sample(*args, **kwargs)
        finally:
            if self._events:
                self._events[-1][1] = self._mark()
            self.host.append(("launch", t0, time.perf_counter()))

    def device_intervals(self) -> list[tuple[float, float]]:
        """(start, end) of each step's device work on the host clock."""
        if not self._cuda:
            return [(a, b) for a, b in self._events if b is not None]
        torch.cuda.synchronize(self.device)
        t_host, origin = self._origin
        return [(t_host + origin.elapsed_time(a) / 1e3, t_host + origin.elapsed_time(b) / 1e3)
                for a, b in self._events if b is not None]

    def summary(self) -> dict[str, float]:
        """Milliseconds per step: host busy (the phases' host intervals), device busy, device idle (gaps
        between one step's device work and the next's), and the fraction of the span the device was busy."""
        dev = self.device_intervals()
        n = max(len(dev), 1)
        busy = sum(b - a for a, b in dev)
        idle = sum(max(0.0, a2 - b1) for (_, b1), (a2, _) in itertools.pairwise(dev))
        span = (dev[-1][1] - dev[0][0]) if dev else 0.0
        host = sum(b - a for _, a, b in self.host)
        return {"steps": len(dev), "host_busy_ms_per_step": 1e3 * host / n, "device_busy_ms_per_step": 1e3 * busy / n,
                "device_idle_ms_per_step": 1e3 * idle / n, "device_busy_frac": busy / span if span > 0 else 0.0}

    def window(self, num_steps: int = 30) -> dict[str, Any]:
        """The intervals of `num_steps` consecutive steps from the middle of the run, in ms from the first
        one's start: {"host": [[phase, start, end], ...], "device": [[start, end], ...]}."""
        dev = self.device_intervals()
        if not dev:
            return {"host": [], "device": []}
        first = max(0, len(dev) // 2 - num_steps // 2)
        sel = dev[first : first + num_steps]
        t0, t1 = sel[0][0], sel[-1][1]
        host = [h for h in self.host if h[2] >= t0 and h[1] <= t1]
        t0 = min([t0] + [a for _, a, _ in host])
        return {"host": [[p, 1e3 * (a - t0), 1e3 * (b - t0)] for p, a, b in host],
                "device": [[1e3 * (a - t0), 1e3 * (b - t0)] for a, b in sel]}


def _bind(wrapper: Callable[..., Any], method: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return wrapper(method, *args, **kwargs)
    return wrapped
