"""Goodput under SLOs (DistServe, arXiv 2401.09670, §1 and §2): the highest request rate a system sustains
while at least `target` (90 %) of requests meet *both* their TTFT and TPOT SLOs, divided by its GPUs.

TTFT / TPOT / percentiles / attainment are nano_vllm.metrics' (written once); this module adds per-token
gaps (TPOT averages them away; a prefill stalling decodes shows up as one long gap) and the bisection.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

from nano_vllm.metrics import RequestMetrics, percentile, slo_attainment, summarize


def to_metrics(completions) -> list[RequestMetrics]:
    """nano_distserve Completions (or anything with their fields) as nano_vllm RequestMetrics."""
    return [RequestMetrics(c.request_id, c.arrival_time,
                           c.token_times[0] if c.token_times else None, c.finish_time,
                           c.prompt_len, len(c.output_token_ids), c.finish_reason)
            for c in completions]


def token_gaps(token_times: Sequence[Sequence[float]]) -> list[float]:
    """Every gap between consecutive output tokens of every request."""
    return [b - a for times in token_times for a, b in itertools.pairwise(times)]


def report(completions, ttft_slo: float, tpot_slo: float, duration: float | None = None) -> dict:
    """nano_vllm.metrics.summarize (P50/P90/P99 TTFT, TPOT, latency; joint attainment) plus token gaps."""
    row = summarize(to_metrics(completions), duration, ttft_slo, tpot_slo)
    gaps = token_gaps([c.token_times for c in completions])
    for q in (50, 90, 99):
        row[f"token_gap_p{q}_s"] = percentile(gaps, q)
    return row


def find_goodput(attainment_at: Callable[[float], float], lo: float, hi: float, target: float = 0.9,
                 rel_tol: float = 0.02, max_iter: int = 30) -> float:
    """Highest rate in [lo, hi] with attainment_at(rate) >= target, by bisection (attainment falls as the
    rate rises). Returns 0.0 if even `lo` misses the target, `hi` if `hi` meets it."""
    if attainment_at(lo) < target:
        return 0.0
    if attainment_at(hi) >= target:
        return hi
    for _ in range(max_iter):
        if hi - lo <= rel_tol * lo:
            break
        # rates span decades: bisect in log space
        mid = math.sqrt(lo * hi) if lo > 0 else (lo + hi) / 2
        if attainment_at(mid) >= target:
            lo = mid
        else:
            hi = mid
    return lo


def attainment(metrics: Sequence[RequestMetrics], ttft_slo: float, tpot_slo: float) -> float:
    return slo_attainment(metrics, ttft_slo, tpot_slo)
