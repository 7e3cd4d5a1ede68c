"""Per-kernel breakdown of decode steps — a measurement tool: where a batch-1 step's device time goes.

    python -m nano_vllm.bench workload=batch1              # the breakdown is on for batch-1 workloads
    python -m nano_vllm.bench workload=batch1 profile_steps=0   # off

One torch.profiler pass (CUDA activity: every kernel, also those replayed inside a CUDA graph) over
`steps` decode steps of one request, after the timed run. From the kernel records, in launch order:

* per kernel name: launches per step, µs per launch, µs per step and its share of the step; where the
  engine's layers say how many bytes one launch reads (`kernel_bytes(runner)`: a dict name → bytes, from a
  layer that knows its weights' shapes), the bandwidth it reached. A kernel's time is the part of the step
  it adds: from the later of its start and the previous kernel's end, to its end. Under programmatic
  dependent launch a kernel starts while the one before still runs and waits for it, so its own start-to-
  end interval would count the wait twice;
* the step: device span (first kernel start to last kernel end, per step), device busy (the union of
  kernel intervals) and the bubbles between kernels (span − busy) — what launch gaps and the host cost;
* the largest gaps by (kernel before → kernel after), so a bubble has a name.

The step's wall time (the bench's ms/step) minus the device span is host time the device waited for.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from nano_vllm.sampling_params import SamplingParams


def _kernel_records(prof: Any) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of every CUDA kernel the profiler saw, by start time."""
    out = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0:
            name = e.name()
            if name.startswith(("Memcpy", "Memset", "cudaMemcpy")):
                continue
            out.append((name, e.start_ns() / 1e3, (e.start_ns() + e.duration_ns()) / 1e3))
    out.sort(key=lambda r: r[1])
    return out


def short_name(name: str) -> str:
    """A kernel's name without its template arguments and parameter list (Triton names are plain)."""
    for cut in ("(", "<"):
        name = name.split(cut)[0]
    return name.removeprefix("void ").strip()[:80]


def summarize(records: list[tuple[str, float, float]], steps: int,
              bytes_per_launch: dict[str, int] | None = None, top_gaps: int = 8) -> dict:
    """The breakdown of `records` (name, start µs, end µs) that cover `steps` steps."""
    if not records:
        return {"available": False, "why": "no CUDA kernel was recorded"}
    bytes_per_launch = bytes_per_launch or {}
    span = records[-1][2] - records[0][1]
    busy, cur_end = 0.0, records[0][1]
    gaps: dict[tuple[str, str], list[float]] = defaultdict(list)
    per_name: dict[str, list[float]] = defaultdict(list)
    prev = None
    for name, start, end in records:
        short = short_name(name)
        own = max(0.0, end - max(start, cur_end))  # what this kernel adds to the step
        per_name[short].append(own)
        busy += own
        if prev is not None and start > cur_end:
            gaps[(prev, short)].append(start - cur_end)
        cur_end, prev = max(cur_end, end), short
    kernels = []
    for name, durs in sorted(per_name.items(), key=lambda kv: -sum(kv[1])):
        row = {"kernel": name, "launches/step": len(durs) / steps, "us/launch": sum(durs) / len(durs),
               "us/step": sum(durs) / steps, "% of busy": 100 * sum(durs) / busy}
        nbytes = bytes_per_launch.get(name)
        if nbytes:
            row["GB/s"] = nbytes / (sum(durs) / len(durs)) / 1e3
        kernels.append(row)
    gap_rows = sorted(({"between": f"{a} -> {b}", "count/step": len(v) / steps, "us each": sum(v) / len(v),
                        "us/step": sum(v) / steps} for (a, b), v in gaps.items()), key=lambda r: -r["us/step"])
    return {"available": True, "steps": steps, "kernels/step": len(records) / steps,
            "device span us/step": span / steps, "device busy us/step": busy / steps,
            "bubbles us/step": (span - busy) / steps, "kernels": kernels, "gaps": gap_rows[:top_gaps]}


def kernel_bytes(runner: Any) -> dict[str, int]:
    """Bytes one launch of each kernel reads, from the layers that know it (a `kernel_bytes` attribute
    of the runner's model: a dict kernel name → bytes); empty where none does."""
    return dict(getattr(runner.model, "kernel_bytes", None) or {})


def profile_decode(llm: Any, prompt: list[int], steps: int = 32, warm: int = 8) -> dict:
    """Profile `steps` decode steps of one greedy request of `prompt` on `llm` (an `LLM`), after `warm`
    steps (its prefill among them) that are not recorded."""
    if not torch.cuda.is_available():
        return {"available": False, "why": "no CUDA device"}
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    engine.block_manager.reset_prefix_cache()
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=warm + steps + 4, ignore_eos=True))
    for _ in range(warm):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    return summarize(_kernel_records(prof), steps, kernel_bytes(engine.model_runner))
