"""nano_specdec's performance layer can be deleted: in a copy of the packages with
nano_specdec/layers/draft_chain.py deleted (and with the whole layers folder deleted), `from nano_specdec
import LLM` works, the registry names what is missing, and greedy output with a draft model equals
nano_vllm's plain engine. One process runs both cases."""

from __future__ import annotations

import json

import pytest

from nano_vllm import LLM, SamplingParams

# A deletion test: run from the repository, left out of a fork of the package.
pytestmark = pytest.mark.slow

SMALL = {"max_model_len": 64, "max_num_seqs": 4, "max_num_batched_tokens": 64}
PROMPTS = [[5, 9, 2, 77, 31], [400, 12, 12, 8, 19, 3, 1, 250]]

SCRIPT = '''
import importlib
import json
import shutil
import sys
from pathlib import Path

SMALL, PROMPTS, expected = json.loads(sys.argv[1])
for case in ("draft_chain", "layers"):
    if case == "draft_chain":
        Path("nano_specdec/layers/draft_chain.py").unlink()
    else:
        shutil.rmtree("nano_specdec/layers")
    for module in [m for m in sys.modules if m == "nano_specdec" or m.startswith("nano_specdec.")]:
        del sys.modules[module]
    importlib.invalidate_caches()
    from nano_specdec import LLM
    from nano_specdec.config import REGISTRY
    from nano_vllm import SamplingParams

    spec = {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3}
    llm = LLM("tiny", speculative_config=spec, **SMALL)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)] == expected, case
    assert list(REGISTRY.missing) == ["draft_chain"], (case, REGISTRY.missing)
    assert "draft_chain" not in llm.engine.layers_applied
    print("deleted", case, "ok", flush=True)
'''


def test_nano_specdec_runs_with_its_layer_deleted(run_in_copy):
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    plain = LLM("tiny", **SMALL)
    expected = [o.token_ids for o in plain.generate(PROMPTS, greedy, use_tqdm=False)]
    args = json.dumps([SMALL, PROMPTS, expected])
    proc = run_in_copy(["nano_specdec", "nano_vllm", "shared", "nano_flashattn", "nano_quant"], [],
                       f"import sys; sys.argv[1:] = [{args!r}]\n" + SCRIPT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(" ok") == 2, proc.stdout
