"""nano_vllm without nano_quant: every module imports and a 16-bit model is served (nano_quant is imported
only for a quantized model), and asking for quantization names the missing package."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECK = textwrap.dedent('''
    import importlib, pkgutil, sys
    sys.modules["nano_quant"] = None  # import nano_quant now raises ImportError, as in a copy without it
    import nano_vllm
    for info in pkgutil.walk_packages(nano_vllm.__path__, "nano_vllm."):
        importlib.import_module(info.name)
    from nano_vllm import LLM, SamplingParams
    args = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=64)
    out = LLM("tiny", **args).generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out[0].token_ids) == 4
    try:
        LLM("tiny", quantization="rtn-w4", **args)
    except ImportError as e:
        assert "quantization='rtn-w4' needs the nano_quant package" in str(e), e
    else:
        raise AssertionError("quantization without nano_quant did not raise")
    print("ok")
''')


@pytest.mark.slow  # a fresh interpreter importing every module: ~10 s, run once (not again in the fork test)
def test_nano_vllm_runs_without_nano_quant():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-3000:]
