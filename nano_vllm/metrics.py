"""Serving metrics, written once for nano_vllm, nano_sglang and nano_distserve.

* TTFT (time to first token): arrival -> first output token; what prefill speed and queueing decide.
* TPOT (time per output token): (last token - first token) / (outputs - 1); what decode speed decides.
  vLLM's paper reports normalized latency (end-to-end latency / output length, §6); we report it too.
* Percentiles over requests (p50 / p90 / p99) and SLO attainment: the fraction of requests whose TTFT and
  TPOT both meet their targets (DistServe, arXiv 2401.09670, §2 — "goodput" is the highest request rate
  at which attainment stays above a target, found by sweeping the open-loop rate of nano_vllm.loadgen).
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import asdict, dataclass


@dataclass
class RequestMetrics:
    """Timestamps (seconds, any common clock) and sizes of one finished request."""

    request_id: str
    arrival_time: float
    first_token_time: float | None
    finish_time: float
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        if self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def latency(self) -> float:
        return self.finish_time - self.arrival_time

    @property
    def normalized_latency(self) -> float | None:
        """§6 of the vLLM paper: end-to-end latency divided by the output length (s/token)."""
        return self.latency / self.num_output_tokens if self.num_output_tokens else None

    @classmethod
    def from_sequence(cls, seq) -> RequestMetrics:
        """From a finished nano_vllm Sequence (its arrival, token and finish times)."""
        times = seq.token_times
        return cls(seq.request_id, seq.arrival_time, times[0] if times else None,
                   seq.finish_time if seq.finish_time is not None else (times[-1] if times else seq.arrival_time),
                   seq.num_prompt_tokens, seq.num_output_tokens, seq.finish_reason)

    def to_dict(self) -> dict:
        return {**asdict(self), "ttft": self.ttft, "tpot": self.tpot, "latency": self.latency}


def percentile(values: Seq[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def slo_attainment(metrics: Seq[RequestMetrics], ttft_slo: float | None = None,
                   tpot_slo: float | None = None) -> float:
    """Fraction of requests meeting every given SLO (a request without a TPOT meets the TPOT SLO)."""
    if not metrics:
        return math.nan
    ok = 0
    for m in metrics:
        ttft_ok = ttft_slo is None or (m.ttft is not None and m.ttft <= ttft_slo)
        tpot_ok = tpot_slo is None or m.tpot is None or m.tpot <= tpot_slo
        ok += ttft_ok and tpot_ok
    return ok / len(metrics)


def summarize(metrics: Seq[RequestMetrics], duration: float | None = None, ttft_slo: float | None = None,
              tpot_slo: float | None = None, percentiles: Seq[float] = (50, 90, 99)) -> dict:
    """One flat dict: counts, throughput, mean and percentiles of TTFT / TPOT / latency, SLO attainment."""
    if duration is None:
        duration = (max(m.finish_time for m in metrics) - min(m.arrival_time for m in metrics)) if metrics else 0.0
    out_tokens = sum(m.num_output_tokens for m in metrics)
    row: dict = {"requests": len(metrics), "duration_s": duration, "output_tokens": out_tokens,
                 "request_per_s": len(metrics) / duration if duration > 0 else math.nan,
                 "output_tok_per_s": out_tokens / duration if duration > 0 else math.nan}
    for name in ("ttft", "tpot", "latency", "normalized_latency"):
        values = [v for v in (getattr(m, name) for m in metrics) if v is not None]
        row[f"{name}_mean_s"] = sum(values) / len(values) if values else math.nan
        for q in percentiles:
            row[f"{name}_p{q:g}_s"] = percentile(values, q)
    if ttft_slo is not None or tpot_slo is not None:
        row["slo_attainment"] = slo_attainment(metrics, ttft_slo, tpot_slo)
    return row
