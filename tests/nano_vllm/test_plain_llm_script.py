"""tools/vllm_plain_llm.py — the published workload as a user of `from nano_vllm import LLM` runs it —
draws exactly the bench's workload (nano_vllm.loadgen.nano_vllm_workload), and runs on a tiny scale."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from nano_vllm.loadgen import nano_vllm_workload

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "vllm_plain_llm.py"
pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="tools/ is not part of a copy of nano_vllm")


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("vllm_plain_llm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_script_imports_only_the_public_api():
    imports = [line for line in SCRIPT.read_text().splitlines() if line.startswith(("import ", "from "))]
    assert [i for i in imports if "nano_" in i] == ["from nano_vllm import LLM, SamplingParams"]


@pytest.mark.parametrize("shape", [(256, 100, 1024, 100, 1024, 10000), (5, 8, 16, 3, 6, 4000)])
def test_the_script_draws_the_bench_workload(script, shape):
    prompts, params = script.workload(*shape)
    bench = nano_vllm_workload(*shape)
    assert prompts == [r.prompt for r in bench]
    assert [p.max_tokens for p in params] == [r.sampling_params.max_tokens for r in bench]
    assert all(p.temperature == r.sampling_params.temperature and p.ignore_eos for p, r in zip(params, bench))
    if shape[0] == 256:
        assert sum(p.max_tokens for p in params) == 133_966


@pytest.mark.parametrize("paper_path", [False, True])
def test_the_script_runs_tiny(script, paper_path, capsys):
    args = ["--model", "tiny", "--num-seqs", "3", "--min-input-len", "8", "--max-input-len", "16",
            "--min-output-len", "3", "--max-output-len", "5", "--vocab", "4000", "--max-model-len", "64"]
    result = script.main(args + ["--paper-path"] * paper_path)
    _, params = script.workload(3, 8, 16, 3, 5, 4000)
    assert result["output_tokens"] == sum(p.max_tokens for p in params)
    assert result["layers_applied"] == [] and "Throughput:" in capsys.readouterr().out  # a CPU: no layer
