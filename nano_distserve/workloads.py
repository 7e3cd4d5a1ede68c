"""Synthetic workloads with the SLOs of DistServe's Table 1 (arXiv 2401.09670, §6.1).

No datasets are downloaded: lengths are drawn from log-normal distributions whose medians and spreads
mimic the paper's datasets (Fig. 7 of the paper shows the histograms), clipped to [min, max]:

| workload        | dataset (model)     | prompt median (sigma) | output median (sigma) | TTFT    | TPOT   |
|-----------------|---------------------|-----------------------|-----------------------|---------|--------|
| chatbot         | ShareGPT (OPT-13B)  | 400 (1.0)             | 200 (1.0)             | 0.25 s  | 0.1 s  |
| code_completion | HumanEval (OPT-66B) | 150 (0.4)             | 100 (0.6)             | 0.125 s | 0.2 s  |
| summarization   | LongBench (OPT-66B) | 1500 (0.5)            | 100 (0.6)             | 15 s    | 0.15 s |

The SLOs are the paper's for its GPUs and models; `scaled(...)` multiplies them for smaller setups
(e.g. a tiny model on a CPU), keeping the workload's *shape*: code completion has the tight TTFT,
summarization the long prompts and tight TPOT.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from nano_vllm.loadgen import Request
from nano_vllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class Workload:
    name: str
    prompt_median: float
    prompt_sigma: float
    output_median: float
    output_sigma: float
    ttft_slo: float
    tpot_slo: float
    min_len: int = 4
    max_prompt: int = 4096
    max_output: int = 1024

    def lengths(self, num: int, seed: int = 0) -> list[tuple[int, int]]:
        """(prompt length, output length) pairs, seeded."""
        rng = random.Random(seed)

        def draw(median: float, sigma: float, hi: int) -> int:
            return int(min(max(round(rng.lognormvariate(math.log(median), sigma)), self.min_len), hi))

        return [(draw(self.prompt_median, self.prompt_sigma, self.max_prompt),
                 draw(self.output_median, self.output_sigma, self.max_output)) for _ in range(num)]

    def requests(self, num: int, seed: int = 0, vocab: int = 4096) -> list[Request]:
        """Engine requests (random token ids, greedy, ignore_eos so outputs have their drawn length)."""
        rng = random.Random(seed + 1)
        return [Request([rng.randrange(vocab) for _ in range(p)],
                        SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True))
                for p, o in self.lengths(num, seed)]

    def scaled(self, length: float = 1.0, slo: float = 1.0) -> Workload:
        """Lengths multiplied by `length` (clipped), SLOs by `slo`."""
        return replace(self, prompt_median=self.prompt_median * length,
                       output_median=self.output_median * length,
                       max_prompt=max(int(self.max_prompt * length), self.min_len),
                       max_output=max(int(self.max_output * length), self.min_len),
                       ttft_slo=self.ttft_slo * slo, tpot_slo=self.tpot_slo * slo)


WORKLOADS: dict[str, Workload] = {
    "chatbot": Workload("chatbot", 400, 1.0, 200, 1.0, ttft_slo=0.25, tpot_slo=0.1),
    "code_completion": Workload("code_completion", 150, 0.4, 100, 0.6, ttft_slo=0.125, tpot_slo=0.2),
    "summarization": Workload("summarization", 1500, 0.5, 100, 0.6, ttft_slo=15.0, tpot_slo=0.15),
}


def workload(name: str, key: str = "workload") -> Workload:
    """The Table 1 workload called `name`; any other name is a ValueError naming the setting `key` and the
    choices."""
    if name not in WORKLOADS:
        raise ValueError(f"{key} must be one of {sorted(WORKLOADS)}, got {name!r}")
    return WORKLOADS[name]
