"""Pipeline schedules as plain lists of actions, one list per stage (pure Python, no torch).

The runtime (`pipeline_parallel.PipelineSchedule`) executes these lists with real tensors and the
simulator (`simulator.py`) replays the very same lists with unit costs, so the timelines it prints are
the order the GPUs run.

* GPipe (Huang et al. 2019; "all-forward all-backward", 2104.04473 §2.2.1, Figure 3): every stage runs
  the m forward passes, then the m backward passes. Bubble (p−1)/(m+p−1) of the step; a stage holds
  the activations of all m micro-batches at once.
* 1F1B (PipeDream-Flush; 2104.04473 §2.2.1, Figure 4 top): stage s runs p−s−1 warm-up forwards, then
  alternates one forward and one backward, then drains the remaining backwards. Same bubble as GPipe
  but at most p−s micro-batches are in flight, so activation memory is bounded by p, not m.
* Interleaved 1F1B (2104.04473 §2.2.2, Figure 4 bottom) gives each device v model chunks and shrinks
  the bubble to (p−1)/(v·m+p−1). The runtime does not execute it, so its action list lives beside the
  one program that replays it, `tools/simulator.py`; the bubble formula here covers it.
"""

from __future__ import annotations

from typing import NamedTuple

SCHEDULES = ("gpipe", "1f1b")


class Action(NamedTuple):
    """One unit of work of a stage: forward ("F") or backward ("B") of micro-batch `micro` on model
    chunk `chunk` (always 0 except for the interleaved schedule)."""

    kind: str
    micro: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


def _check(num_stages: int, num_micro: int, stage: int) -> None:
    if num_stages < 1 or num_micro < 1:
        raise ValueError(f"need num_stages >= 1 and num_micro >= 1, got {num_stages}, {num_micro}")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is outside [0, {num_stages})")


def gpipe(num_stages: int, num_micro: int, stage: int) -> list[Action]:
    """All forwards, then all backwards in the same (first-in first-out) order."""
    _check(num_stages, num_micro, stage)
    return [Action("F", i) for i in range(num_micro)] + [Action("B", i) for i in range(num_micro)]


def one_f_one_b(num_stages: int, num_micro: int, stage: int) -> list[Action]:
    """PipeDream-Flush 1F1B: warm-up forwards, steady one-forward-one-backward, cool-down backwards."""
    _check(num_stages, num_micro, stage)
    warmup = min(num_stages - stage - 1, num_micro)
    actions = [Action("F", i) for i in range(warmup)]
    for i in range(num_micro - warmup):
        actions += [Action("F", warmup + i), Action("B", i)]
    actions += [Action("B", i) for i in range(num_micro - warmup, num_micro)]
    return actions


def schedule_actions(schedule: str, num_stages: int, num_micro: int, stage: int) -> list[Action]:
    """The action list of one stage for a named schedule ("gpipe" or "1f1b")."""
    if schedule == "gpipe":
        return gpipe(num_stages, num_micro, stage)
    if schedule == "1f1b":
        return one_f_one_b(num_stages, num_micro, stage)
    raise ValueError(f"unknown pipeline schedule {schedule!r}; choose from {SCHEDULES}")


def bubble_fraction_formula(num_stages: int, num_micro: int, num_chunks: int = 1) -> float:
    """Idle fraction of a pipelined step: (p−1)/(v·m + p−1) (2104.04473 §2.2.1–2.2.2: bubble time
    (p−1)·(t_f+t_b)/v against ideal m·(t_f+t_b))."""
    p, m, v = num_stages, num_micro, num_chunks
    return (p - 1) / (v * m + p - 1)
