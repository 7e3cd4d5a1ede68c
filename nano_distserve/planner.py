"""Placement for disaggregated serving (DistServe, arXiv 2401.09670, §4.1, Algorithm 1 "high node-affinity").

Algorithm 1 searches each phase on its own — prefill and decode instances no longer share anything but
the KV transfer — and replicates the best configuration of each to the traffic:

    for each parallel config of a prefill instance: G_p = simulated goodput of one prefill instance
        (TTFT SLO only);   keep the config with the best G_p / #GPUs
    same for decode (TPOT SLO only)
    n_p = ceil(R / G_p), n_d = ceil(R / G_d)

Here the parallel config is the tensor-parallel degree (nano_vllm has no pipeline parallelism), and for a
fixed GPU budget we enumerate (tp_p, #prefill, tp_d, #decode) directly and keep the best goodput per GPU,
min(n_p G_p, n_d G_d) / (n_p tp_p + n_d tp_d) — §1's arithmetic (Fig. 1): a prefill-only GPU at 5.6 req/s
and a decode-only GPU at 10 req/s give 2P+1D = min(11.2, 10) / 3 ≈ 3.3 req/s per GPU, twice a colocated
GPU's 1.6. `phase_goodputs` measures G_p and G_d with the simulator.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from nano_distserve.goodput import find_goodput
from nano_distserve.simulator import LatencyModel, SimConfig, simulate
from nano_vllm.loadgen import poisson_arrivals
from nano_vllm.metrics import slo_attainment


@dataclass(frozen=True)
class Placement:
    """Algorithm 1's best_plm: (tp, #instances) of each phase and the goodput of the whole placement."""

    tp_prefill: int
    num_prefill: int
    tp_decode: int
    num_decode: int
    goodput: float  # req/s of the whole placement

    @property
    def num_gpus(self) -> int:
        return self.tp_prefill * self.num_prefill + self.tp_decode * self.num_decode

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput / self.num_gpus

    def __str__(self) -> str:
        return (f"{self.num_prefill}P(tp{self.tp_prefill})+{self.num_decode}D(tp{self.tp_decode}): "
                f"{self.goodput:.3g} req/s, {self.goodput_per_gpu:.3g} req/s/GPU")


def plan(prefill_goodput: Callable[[int], float], decode_goodput: Callable[[int], float],
         gpu_budget: int, tps: Sequence[int] = (1, 2, 4, 8)) -> Placement:
    """The (tp, #prefill, tp, #decode) within `gpu_budget` GPUs with the highest goodput per GPU (ties: more
    total goodput). `prefill_goodput(tp)` / `decode_goodput(tp)`: req/s one instance sustains under its
    SLO (Algorithm 1's simu_prefill / simu_decode)."""
    best: Placement | None = None
    tps = [t for t in tps if t <= gpu_budget]
    gp = {t: prefill_goodput(t) for t in tps}
    gd = {t: decode_goodput(t) for t in tps}
    for tp_p in tps:
        for tp_d in tps:
            for n_p in range(1, (gpu_budget - tp_d) // tp_p + 1):
                for n_d in range(1, (gpu_budget - n_p * tp_p) // tp_d + 1):
                    p = Placement(tp_p, n_p, tp_d, n_d, min(n_p * gp[tp_p], n_d * gd[tp_d]))
                    score = (p.goodput_per_gpu, p.goodput)
                    if best is None or score > (best.goodput_per_gpu, best.goodput):
                        best = p
    if best is None:
        raise ValueError(f"a GPU budget of {gpu_budget} cannot hold one prefill and one decode "
                         "instance")
    return best


def phase_goodputs(model: LatencyModel, base: SimConfig, lengths: list[tuple[int, int]],
                   ttft_slo: float, tpot_slo: float, max_rate: float = 1000.0, target: float = 0.9,
                   seed: int = 0) -> tuple[Callable[[int], float], Callable[[int], float]]:
    """G_p(tp), G_d(tp) from the simulator: one prefill instance judged on TTFT alone (fed by as many decode
    instances as needed), and one decode instance judged on TPOT alone (fed by as many prefill instances)."""
    @functools.cache
    def g_p(tp: int) -> float:
        cfg = replace(base, mode="disaggregated", num_prefill=1, tp_prefill=tp, num_decode=16,
                      tp_decode=8)
        return colocated_goodput(model, cfg, lengths, ttft_slo, None, max_rate, target, seed)

    @functools.cache
    def g_d(tp: int) -> float:
        cfg = replace(base, mode="disaggregated", num_prefill=16, tp_prefill=8, num_decode=1,
                      tp_decode=tp)
        return colocated_goodput(model, cfg, lengths, None, tpot_slo, max_rate, target, seed)

    return g_p, g_d


def colocated_goodput(model: LatencyModel, base: SimConfig, lengths: list[tuple[int, int]],
                      ttft_slo: float | None, tpot_slo: float | None, max_rate: float = 1000.0,
                      target: float = 0.9, seed: int = 0,
                      decode_model: LatencyModel | None = None) -> float:
    """Goodput (§2) of `base` (any mode, not only colocated) by simulation and bisection: the highest
    Poisson rate at which `target` of the requests meet both SLOs (an SLO of None is not judged).
    `decode_model`: see `simulate`."""
    def att(rate: float) -> float:
        arrivals = poisson_arrivals(len(lengths), rate, seed=seed)
        metrics = simulate(base, model, lengths, arrivals, decode_model)
        return slo_attainment(metrics, ttft_slo, tpot_slo)
    return find_goodput(att, max_rate / 1e4, max_rate, target)
