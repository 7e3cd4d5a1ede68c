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
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from nano_vllm.engine import LLMEngine
from nano_vllm.scheduler import SchedulerOutput

PHASES = ("schedule", "execute", "postprocess", "prepare")


class StepTimer:
    """Installed on one engine by its constructor; `on_step(out, seconds)` is called after each step with
    the SchedulerOutput and the step's wall time from the start of its schedule to the end of its
    postprocess."""

    def __init__(self, engine: LLMEngine, on_step: Callable[[SchedulerOutput, float], None] | None = None):
        self.on_step = on_step
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.num_steps = 0
        self.num_eager_steps = 0
        self._step_start = 0.0
        sched, runner = engine.scheduler, engine.model_runner
        # (instance, method name, what the instance itself held under that name: another wrapper, or None)
        self._installed: list[tuple[Any, str, Any]] = []
        for obj, name, wrapper in ((sched, "schedule", self._schedule),
                                   (runner, "prepare", self._timed("prepare")),
                                   (runner, "execute", self._timed("execute")),
                                   (sched, "postprocess", self._postprocess),
                                   (runner, "forward", self._forward)):
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
            self.seconds["schedule"] += time.perf_counter() - t0
            self._step_start = t0
        return out

    def _timed(self, phase: str) -> Callable[..., Any]:
        def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - t0
        return timed

    def _postprocess(self, postprocess: Callable[..., Any], out: SchedulerOutput, *args: Any,
                     **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        finished = postprocess(out, *args, **kwargs)
        t1 = time.perf_counter()
        self.seconds["postprocess"] += t1 - t0
        self.num_steps += 1
        if self.on_step is not None:
            self.on_step(out, t1 - self._step_start)
        return finished

    def _forward(self, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.num_eager_steps += 1
        return forward(*args, **kwargs)


def _bind(wrapper: Callable[..., Any], method: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return wrapper(method, *args, **kwargs)
    return wrapped
