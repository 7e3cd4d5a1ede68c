"""`python -m nano_specdec.bench` on a CPU: the quick run (the tiny model as target and as its own draft) with
the cost side, its bench.json, its figure through `python -m shared.report` and the short table it prints
last; the held-out workloads; bad bench inputs named before an engine is built; and the draft's weights and
KV cache reported beside the target's (nano_specdec.memory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nano_specdec import LLM
from nano_specdec.bench import speedup
from nano_specdec.bench.workloads import EDIT_ASK, make_prompts
from nano_specdec.memory import GiB, memory_record, memory_summary
from nano_vllm.kv_cache import weight_bytes
from shared.data import stdlib_split
from shared.tokenizer import get_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "nano_specdec" / "configs"


def compose(*overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        return hydra_compose(config_name="bench", overrides=list(overrides))


def test_quick_bench_with_costs_writes_its_json_and_figure(tmp_path):
    args = ["quick=true", "cost=true", "workloads=[code,edit]", "batch_sizes=[1,2]", "prompt_tokens=64",
            "output_tokens=12", f"hydra.run.dir={tmp_path / 'run'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "nano_specdec.bench", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    title = next(i for i, line in enumerate(lines) if line.startswith("speedup over nano_vllm"))
    assert len(lines) - title == 3 + 2 * 2 * 2  # the short table is last: a row per method, workload, T
    rec = json.loads((tmp_path / "run" / "bench.json").read_text())
    assert rec["bench"] == "nano_specdec" and rec["quick"] and rec["model"] == "tiny"
    rows = rec["rows"]
    assert len(rows) == 2 * 2 * 2 * 2  # methods x workloads x batch sizes x temperatures
    k = rec["num_speculative_tokens"]
    for r in rows:
        assert r["tok/s"] > 0 and r["plain tok/s"] > 0 and r["speedup"] > 0
        assert r["requests"] == max(r["batch"], 2) and r["output tokens"] == 12 * r["requests"]
        assert len(r["_acceptance_by_position"]) <= k
        if r["temperature"] == 0:  # greedy: the plain engine's tokens
            assert r["same tokens %"] == 100
        if r["method"] == "draft_model":  # the target as its own draft: every draft accepted
            assert r["acceptance %"] == 100 and r["tau"] > 2 and r["draft ms/step"] > 0
            assert all(a == 1 for a in r["_acceptance_by_position"])
    memory = rec["memory"]
    assert memory["ngram"]["draft"] is None
    draft, target = memory["draft_model"]["draft"], memory["draft_model"]["target"]
    assert draft["model"] == "tiny" and draft["kv_blocks"] == target["kv_blocks"] > 0
    assert draft["weights_GiB"] == target["weights_GiB"] > 0
    cost = rec["cost"]
    assert cost["label"] == "projection" and [s["batch"] for s in cost["steps"]] == [1, 2]
    assert all(s["decode ms"] > 0 and s[f"verify ms ({k + 1} tokens)"] > 0 and s["draft step ms"] > 0
               and s["verify ms, varlen kernel"] > 0 for s in cost["steps"])
    assert {p["method"] for p in cost["projection"]} == {"ngram", "draft_model"}
    pytest.importorskip("matplotlib")
    from shared import report

    written = report.render(tmp_path / "run", tmp_path / "img", only=["specdec"])
    png = tmp_path / "img" / "specdec_speedup.png"
    assert written == [f"wrote {png}"] and png.read_bytes()[:4] == b"\x89PNG"


def test_eagle_cost_is_one_target_layer_and_its_head_chained_k_times():
    """EAGLE's draft at the target's shape (one decoder layer, the tied head) is timed beside the others,
    and a chain of k of its steps is what the projection charges an EAGLE row."""
    from nano_specdec.bench.cost import eagle_shape, measure_costs, projection
    from nano_vllm.config import EngineConfig

    shape = eagle_shape("llama3-8b")
    assert shape["num_hidden_layers"] == 1 and shape["tie_word_embeddings"]
    assert (shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]) == (4096, 14336, 128256)
    base = EngineConfig(model="tiny", device="cpu", dtype="float32", enforce_eager=True)
    costs = measure_costs(base, "tiny", "tiny", 2, [1], 8, "cpu", eagle=True)
    assert costs[0]["eagle step ms"] > 0 and costs[0]["eagle / decode"] > 0
    row = {"method": "eagle", "workload": "code", "batch": 1, "temperature": 0.0, "tau": 2.5, "verified %": 100.0}
    (proj,) = projection(costs, [row], 2)
    assert proj["draft ms"] == 2 * costs[0]["eagle step ms"]
    assert proj["step ms"] == proj["draft ms"] + costs[0]["verify ms (3 tokens)"]


def test_workloads_come_from_held_out_files_and_say_when_they_repeat():
    enc = get_tokenizer()

    def encode(text: str) -> list[int]:
        return enc.encode(text, disallowed_special=())

    for workload in ("code", "text"):
        prompts, notes = make_prompts(workload, encode, 64, 16)
        assert len(prompts) == 16 and all(len(p) == 64 for p in prompts) and not notes
        assert len({tuple(p) for p in prompts}) == 16
    edits, _ = make_prompts("edit", encode, 160, 4)
    for p in edits:  # a held-out file, the ask to rewrite it, and the rewrite's first line
        text = enc.decode(p)
        path = text.split(",", 1)[0].removeprefix("### ")
        assert stdlib_split(path) == "val" and EDIT_ASK.format(path=path) in text
        first = text.split("\n", 1)[1].split("\n", 1)[0]
        assert text.endswith(first + "\n") and len(p) <= 160
    prompts, notes = make_prompts("edit", encode, 40, 64)
    assert len(prompts) == 64 and "reused" in notes[0]
    with pytest.raises(ValueError, match="unknown workload 'chat'"):
        make_prompts("chat", encode, 64, 4)


@pytest.mark.parametrize("overrides, error, match", [
    (["methods=[ngram,lookahead]"], ValueError, "unknown method 'lookahead'"),
    (["num_speculative_tokens=0"], ValueError, "num_speculative_tokens"),
    (["+speculative.ngram.window=3"], TypeError, "window"),
])
def test_bad_methods_are_named_before_an_engine_is_built(overrides, error, match):
    with pytest.raises(error, match=match):
        speedup.spec_configs(compose(*overrides))


def test_a_request_longer_than_max_model_len_is_named():
    cfg = compose("model=tiny", "engine.max_model_len=128", "prompt_tokens=100", "output_tokens=40")
    with pytest.raises(ValueError, match="max_model_len \\(128\\)"):
        speedup.engine_args(cfg, 4)
    args = speedup.engine_args(compose("model=tiny", "prompt_tokens=100", "output_tokens=40"), 4)
    assert args["max_model_len"] == 160 and args["num_kv_blocks"] == 64 * 11
    assert args["max_num_seqs"] == 64


def test_llm_reports_the_drafts_weights_and_kv_like_the_targets():
    args = dict(device="cpu", max_model_len=128, num_kv_blocks=24)
    llm = LLM("tiny", speculative_config={"method": "draft_model", "num_speculative_tokens": 3,
                                          "model": "tiny"}, **args)
    engine = llm.engine
    rec = memory_record(engine)
    target, draft = rec["target"], rec["draft"]
    runner = engine.proposer.runner
    assert draft["weights_GiB"] == weight_bytes(runner.model) / GiB == target["weights_GiB"]
    assert draft["kv_blocks"] == target["kv_blocks"] == 24
    assert draft["kv_cache_GiB"] == 24 * runner.block_bytes / GiB
    assert rec["total_GiB"] == pytest.approx(2 * (target["weights_GiB"] + target["kv_cache_GiB"]))
    line = memory_summary(engine)
    assert line.startswith("target: weights:") and "; draft 'tiny': weights:" in line
    assert line.count("KV cache (float32): 24 blocks") == 2
    ngram = LLM("tiny", speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **args)
    assert memory_record(ngram.engine)["draft"] is None
    assert memory_summary(ngram.engine).endswith("draft (ngram): no model (host-side lookup)")


def test_kv_cache_memory_bytes_holds_the_drafts_pool_too():
    """§5's sizing gives the memory to the target's and the draft's pools together (one draft block per
    target block), so the draft loaded after the target does not run past the engine's memory."""
    budget = 40 * 2**20
    llm = LLM("tiny", speculative_config={"method": "draft_model", "num_speculative_tokens": 3,
                                          "model": "tiny"}, device="cpu", max_model_len=128,
              kv_cache_memory_bytes=budget)
    target, draft = llm.engine.model_runner, llm.engine.proposer.runner
    assert target.block_bytes == draft.block_bytes  # the same model twice; after sizing, its own block
    assert target.num_blocks == draft.num_blocks == budget // (2 * target.block_bytes)
    assert llm.engine.model_runner.draft_bytes == (weight_bytes(draft.model), draft.block_bytes)


def test_cost_runner_verifies_like_the_engine():
    """The cost side's target runner keeps k + 1 logits rows a sequence and graph sizes of k + 1 tokens a
    decode batch (as SpecModelRunner does): a verify step is not padded to a prefill graph or run eagerly."""
    from nano_specdec.bench.cost import make_runner
    from nano_vllm.config import EngineConfig
    from nano_vllm.layers.cudagraph import mixed_sizes

    base = EngineConfig(model="tiny", device="cpu")
    runner = make_runner(base, "tiny", 4, 4, 64, rows_per_seq=5)
    assert runner.sample_rows_per_seq == 5
    assert {5, 10, 20} <= set(mixed_sizes(runner.config, runner.sample_rows_per_seq))
    assert getattr(make_runner(base, "tiny", 4, 4, 64), "sample_rows_per_seq", 1) == 1
