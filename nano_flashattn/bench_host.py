"""What a CPU bench says about the host it runs on: whether torch's intra-op threads outnumber the cores
that are actually free to run them.

OpenMP-style thread pools split each op into one chunk per thread and wait for the last chunk: with more
threads than free cores, every op waits for a thread the scheduler parked behind another process, and a
small model's step can take many times longer than with one thread. A bench on a CPU calls
`oversubscription_warning(device)` once, before timing, and prints what it returns.

nano_flashattn imports nothing of the project, so this lives here, where every package's bench can reach
it (`shared.bench.oversubscription_warning` is the same function).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch


def cgroup_cpu_quota(text: str | None = None) -> float | None:
    """CPUs granted by the cgroup v2 quota (`/sys/fs/cgroup/cpu.max`, e.g. "200000 100000" -> 2.0, a
    container's CPU limit); None without a quota ("max ...") or without the file. `text`: parse this."""
    if text is None:
        try:
            text = Path("/sys/fs/cgroup/cpu.max").read_text()
        except OSError:
            return None
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max" or not parts[0].isdigit() or not parts[1].isdigit():
        return None
    return int(parts[0]) / int(parts[1]) if int(parts[1]) else None


def _affinity() -> list[int] | None:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def usable_cores() -> float:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota."""
    mine = _affinity()
    cores = float(len(mine) if mine else os.cpu_count() or 1)
    quota = cgroup_cpu_quota()
    return min(cores, quota) if quota else cores


def _cpu_times() -> dict[int, tuple[int, int]]:
    """{cpu: (idle + iowait, total) clock ticks} from /proc/stat (Linux; empty elsewhere)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and len(fields) >= 5:
            ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
            out[int(name[3:])] = (ticks[3] + ticks[4], sum(ticks))
    return out


def busy_fraction(sample_s: float = 0.2) -> float:
    """The share of this process's cores (0..1) other work kept busy: measured from /proc/stat over
    `sample_s` while this process sleeps (Linux); elsewhere the 1-minute load average, less this process,
    over the machine's cores."""
    mine = _affinity()
    before = _cpu_times()
    if mine and before:
        time.sleep(sample_s)
        after = _cpu_times()
        shares = []
        for cpu in mine:
            if cpu in before and cpu in after and after[cpu][1] > before[cpu][1]:
                idle, total = (a - b for a, b in zip(after[cpu], before[cpu]))
                shares.append(1.0 - idle / total)
        if shares:
            return min(1.0, max(0.0, sum(shares) / len(shares)))
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0
    return min(1.0, max(0.0, load - 1.0) / (os.cpu_count() or 1))


def oversubscription_warning(device: str | torch.device = "cpu", threads: int | None = None,
                             processes: int | None = None, usable: float | None = None,
                             busy: float | None = None) -> str | None:
    """A one-line warning when torch's intra-op threads (`threads`, default torch.get_num_threads(), in
    each of `processes` processes of this job on this host, default $LOCAL_WORLD_SIZE or 1) outnumber the
    cores free to run them: the `usable` cores (affinity, cgroup quota) less the `busy` share other work
    holds (measured, see `busy_fraction`). None on a GPU, and when they fit (with a quarter of the cores, or
    half a core, of slack, so background noise does not warn)."""
    if torch.device(device).type != "cpu":
        return None
    threads = torch.get_num_threads() if threads is None else threads
    processes = processes or int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    usable = usable_cores() if usable is None else usable
    busy = busy_fraction() if busy is None else busy
    free = usable * (1.0 - busy)
    wanted = threads * processes
    if wanted <= 1 or wanted <= free + max(0.5, 0.25 * usable):
        return None
    each = f" in each of {processes} processes" if processes > 1 else ""
    suggest = max(1, int(free // processes))
    return (f"warning: torch runs {threads} intra-op thread(s){each} on {usable:g} usable core(s), of which "
            f"about {free:.1f} are free (other work keeps {busy:.0%} of them busy): CPU timings may come out "
            f"many times slower than this machine allows; rerun with OMP_NUM_THREADS={suggest} "
            f"(or torch.set_num_threads({suggest}))")


__all__ = ["busy_fraction", "cgroup_cpu_quota", "oversubscription_warning", "usable_cores"]
