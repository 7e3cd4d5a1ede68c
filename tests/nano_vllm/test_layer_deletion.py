"""Every performance layer of nano_vllm can be deleted: in a copy of nano_vllm, shared, nano_flashattn and
nano_quant with layers/cudagraph.py, overlap.py, fused.py, gemv.py, fused_decode.py, fused_sampling.py or
warmup.py deleted
(one at a time, and all at once), `from nano_vllm import LLM` works, a tiny model's greedy tokens equal the
full repository's paper path (computed here with `performance_layers=False`) with the default layers and
with every remaining layer asked for, the registry names what is missing, and asking for a deleted layer
is a ValueError naming its switch and module.

One process runs every case: it deletes the files of a case, drops nano_vllm's modules and imports it
afresh (a new registry), so the copy and the interpreter start are paid once."""

from __future__ import annotations

import json

import pytest

from nano_vllm import LLM, SamplingParams

# A deletion test: run from the repository, left out of a fork of the package.
pytestmark = pytest.mark.slow

LAYERS = ("cudagraph", "overlap", "fused", "gemv", "fused_decode", "fused_sampling", "warmup")
SMALL = {"max_model_len": 64, "max_num_seqs": 4, "max_num_batched_tokens": 64}
PROMPTS = [[5, 9, 2, 77, 31], [400, 12, 12, 8, 19, 3, 1, 250]]

SCRIPT = '''
import importlib
import json
import sys
from pathlib import Path

LAYERS, SMALL, PROMPTS, expected = json.loads(sys.argv[1])
# a switch that asks for each layer that has one (asked for anywhere, a CPU too)
SWITCHES = {"overlap": {"async_scheduling": True}, "fused": {"fused_projections": True},
            "gemv": {"gemv_max_tokens": 1}, "fused_sampling": {"fused_sampling": True},
            "fused_decode": {"fused_decode": True}}
folder = Path("nano_vllm/layers")
sources = {name: (folder / f"{name}.py").read_text() for name in LAYERS}
cases = [[name] for name in LAYERS] + [list(LAYERS)]
for deleted in cases:
    for name in LAYERS:  # this case's files: the deleted ones gone, the others back
        path = folder / f"{name}.py"
        if name in deleted:
            path.unlink(missing_ok=True)
        else:
            path.write_text(sources[name])
    for module in [m for m in sys.modules if m == "nano_vllm" or m.startswith("nano_vllm.")]:
        del sys.modules[module]
    importlib.invalidate_caches()
    from nano_vllm import LLM, SamplingParams
    from nano_vllm.config import REGISTRY

    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    def tokens(llm):
        return [o.token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]

    default = LLM("tiny", **SMALL)
    assert sorted(REGISTRY.missing) == sorted(deleted), (deleted, REGISTRY.missing)
    assert tokens(default) == expected, deleted
    present = {k: v for name, switch in SWITCHES.items() if name not in deleted for k, v in switch.items()}
    asked = LLM("tiny", **SMALL, **present)
    wanted = [n for n in REGISTRY.modules if n in SWITCHES and n not in deleted]
    assert asked.engine.layers_applied == wanted, (deleted, asked.engine.layers_applied)
    assert tokens(asked) == expected, deleted
    for name in deleted:
        for switch, value in SWITCHES.get(name, {}).items():
            try:
                LLM("tiny", **SMALL, **{switch: value})
            except ValueError as e:
                assert f"{switch}={value!r}" in str(e) and f"nano_vllm.layers.{name}" in str(e), e
            else:
                raise AssertionError(f"{switch}={value!r} with layers/{name}.py deleted did not raise")
    print("deleted", ",".join(deleted), "ok", flush=True)
'''


def test_nano_vllm_runs_its_paper_path_with_any_layer_file_deleted(run_in_copy):
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    paper = LLM("tiny", **SMALL, performance_layers=False)
    expected = [o.token_ids for o in paper.generate(PROMPTS, greedy, use_tqdm=False)]
    args = json.dumps([LAYERS, SMALL, PROMPTS, expected])
    proc = run_in_copy(["nano_vllm", "shared", "nano_flashattn", "nano_quant"], [],
                       f"import sys; sys.argv[1:] = [{args!r}]\n" + SCRIPT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(" ok") == len(LAYERS) + 1, proc.stdout
