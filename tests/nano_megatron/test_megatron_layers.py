"""The paper path and the performance layers: the files nano_megatron/README.md's `## Read the code` lists
import no layer; `build_engine` stacks the layers a ParallelConfig switches on; a plain MegatronEngine
refuses a layer switch with an error that says where the layer lives; and with every layer file deleted
the package still imports, trains and says what is missing."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist
from megatron_cases import model_config, train_config

from nano_megatron.build import LAYERS, build_engine, engine_class
from nano_megatron.engine import LAYER_FLAGS, MegatronEngine, ParallelConfig
from shared.dist import destroy_distributed, init_distributed

ROOT = Path(__file__).resolve().parents[2]
LAYER_MODULES = {module for module, _ in LAYERS.values()} | {"nano_megatron.build"}


def paper_path() -> list[Path]:
    text = (ROOT / "nano_megatron" / "README.md").read_text()
    section = re.search(r"^## Read the code\s*$(.*?)(?=^## |\Z)", text, re.S | re.M).group(1)
    table = [line for line in section.splitlines() if line.startswith("|")]
    return [ROOT / "nano_megatron" / name for line in table for name in re.findall(r"`([\w.]+\.py)`", line)]


def test_paper_path_imports_no_layer():
    files = paper_path()
    assert len(files) >= 6, files
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            assert not set(names) & LAYER_MODULES, f"{path.name} imports a performance layer: {names}"


def test_engine_class_stacks_the_switched_on_layers():
    assert set(LAYERS) == set(LAYER_FLAGS)
    assert engine_class(ParallelConfig()) is MegatronEngine
    assert engine_class(ParallelConfig(tp_comm_overlap=True)).__name__ == "TPCommOverlapEngine"
    both = engine_class(ParallelConfig(cuda_graph=True, tp_comm_overlap=True))
    assert [c.__name__ for c in both.__mro__[1:4]] == ["CUDAGraphEngine", "TPCommOverlapEngine", "MegatronEngine"]
    assert {c.layer_flag for c in both.__mro__ if getattr(c, "layer_flag", None)} == {"cuda_graph",
                                                                                      "tp_comm_overlap"}


@pytest.fixture
def one_rank():
    created = not dist.is_initialized()
    init_distributed()
    yield
    if created:
        destroy_distributed()


@pytest.mark.parametrize("flag", LAYER_FLAGS)
def test_plain_engine_refuses_a_layer_switch(one_rank, flag):
    with pytest.raises(ValueError, match=rf"parallel.{flag} is a performance layer: build the engine with "
                                         r"nano_megatron.build_engine"):
        MegatronEngine(model_config(), ParallelConfig(**{flag: True}), train_config())


def test_seq_len_longer_than_the_model_raises_before_any_collective(one_rank):
    with pytest.raises(ValueError, match=r"train.seq_len \(4096\) exceeds the model's max_position_embeddings "
                                         r"\(2048\)"):
        MegatronEngine(model_config(), ParallelConfig(), train_config(seq_len=4096))


def test_layer_engines_validate_before_any_collective(one_rank):
    with pytest.raises(ValueError, match="parallel.cuda_graph needs a CUDA device"):
        build_engine(model_config(), ParallelConfig(cuda_graph=True), train_config(), device="cpu")
    with pytest.raises(ValueError, match=r"micro_batch_size \(4\) x dp \(1\)\) = 1 must be even"):
        build_engine(model_config(), ParallelConfig(overlap_micro_batches=True), train_config(micro_batch_size=4))


CHECK = textwrap.dedent('''
    import sys
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()
                        and "editable" not in repr(f).lower()]
    import torch
    import nano_megatron
    from nano_megatron import ParallelConfig, build_engine
    from shared.config import ModelConfig
    from shared.dist import init_distributed
    from shared.train import TrainConfig, micro_batches_of

    assert nano_megatron.__file__.startswith(sys.argv[1])
    init_distributed()
    mc = ModelConfig.from_name("tiny").replace(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                               head_dim=8, vocab_size=97)
    cfg = TrainConfig(global_batch_size=2, micro_batch_size=1, seq_len=8)
    engine = build_engine(mc, ParallelConfig(), cfg)
    x = torch.randint(0, 97, (2, 9))
    print("loss", engine.train_step(micro_batches_of(x[:, :-1], x[:, 1:], 1), 1e-3).loss)
    for flag in ("tp_comm_overlap", "cuda_graph", "overlap_micro_batches"):
        try:
            build_engine(mc, ParallelConfig(**{flag: True}), cfg)
        except ValueError as e:
            print(e)
''')


def test_package_runs_with_every_layer_file_deleted(tmp_path):
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "outputs")
    for name in ("nano_megatron", "shared", "nano_flashattn"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=ignore)
    for module, _ in LAYERS.values():
        (tmp_path / (module.replace(".", "/") + ".py")).unlink()
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", CHECK, str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("loss ")
    for module, _ in LAYERS.values():
        assert f"needs the performance layer {module}, which is not installed" in proc.stdout, proc.stdout
