"""The measurement lives off the paper path: in a copy of nano_distserve (with nano_vllm, shared, nano_flashattn
and nano_quant) whose whole `bench/` folder — the benchmark and the measurement it reads — is deleted, every
remaining module imports and 1 prefill + 1 decode process on gloo (`disagg.instance_main`, the paper path's
own rank body) serve greedy tokens equal to colocated nano_vllm's in the full repository.

The copy runs under `python -S` (the `run_in_copy` fixture), so the editable install cannot find the deleted
files in the checkout; the spawned ranks inherit the interpreter flags and the path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nano_vllm import LLM, SamplingParams

# A deletion test: run from the repository, left out of a fork of the package.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["nano_distserve", "nano_vllm", "shared", "nano_flashattn", "nano_quant"]
ENGINE = {"model": "tiny", "max_model_len": 64, "num_kv_blocks": 16}
PROMPTS = [[5, 9, 2, 77, 31], [400, 12, 12, 8, 19, 3, 1, 250], [7] * 20]

SCRIPT = '''
import importlib
import importlib.util
import json
import pkgutil

import nano_distserve
from nano_distserve.disagg import DisaggConfig, run_disaggregated
from nano_vllm.loadgen import Request
from nano_vllm.sampling_params import SamplingParams

engine, prompts, expected = json.loads(ARGS)
assert importlib.util.find_spec("nano_distserve.bench.measure") is None, "the copy still has the bench"
modules = [m.name for m in pkgutil.walk_packages(nano_distserve.__path__, "nano_distserve.")]
for name in modules:
    importlib.import_module(name)
greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
res = run_disaggregated(DisaggConfig(engine=engine), [Request(p, greedy) for p in prompts],
                        [0.0] * len(prompts), timeout_s=240)
got = [c.output_token_ids for c in res["completions"]]
assert got == expected, (got, expected)
print("served", len(got), "requests; modules:", ",".join(sorted(modules)), flush=True)
'''


def test_the_paper_path_serves_with_the_bench_and_its_measurement_deleted(run_in_copy):
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(ENGINE["model"], **{k: v for k, v in ENGINE.items() if k != "model"})
    expected = [o.token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    bench = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "nano_distserve" / "bench").rglob("*.py"))
    assert "nano_distserve/bench/measure.py" in bench
    args = json.dumps([ENGINE, PROMPTS, expected])
    proc = run_in_copy(PACKAGES, bench, f"ARGS = {args!r}\n" + SCRIPT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "served 3 requests" in proc.stdout
    assert "nano_distserve.disagg" in proc.stdout and "nano_distserve.bench" not in proc.stdout
