"""The paper path and the performance layers: the files nano_megatron/README.md's `## Read the code` lists
import no layer; the registry lists every file of `layers/`; `engine_class` stacks the layers a
LayerConfig asks for and those that apply (tri-state switches, the `performance_layers` switch); the
layer engines validate before any collective; and with layer files deleted the package still imports,
trains to the paper path's loss, and names a deleted layer when it is asked for."""

from __future__ import annotations

import ast
import json
import re
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from megatron_cases import model_config, train_config

from nano_flashattn.registry import layers_enabled, performance_layers
from nano_megatron.build import (
    REGISTRY,
    SWITCHES,
    LayerConfig,
    PaperPathEngine,
    build_engine,
    engine_class,
    layer_names,
)
from nano_megatron.engine import MegatronEngine, ParallelConfig
from shared.config import ModelConfig
from shared.dist import destroy_distributed, init_distributed
from shared.train import TrainConfig, micro_batches_of

ROOT = Path(__file__).resolve().parents[2]
OFF_THE_PAPER_PATH = ("nano_megatron.layers", "nano_megatron.tools", "nano_megatron.bench",
                      "nano_megatron.build")


def paper_path() -> list[Path]:
    text = (ROOT / "nano_megatron" / "README.md").read_text()
    section = re.search(r"^## Read the code\s*$(.*?)(?=^## |\Z)", text, re.S | re.M).group(1)
    table = [line for line in section.splitlines() if line.startswith("|")]
    return [ROOT / "nano_megatron" / name for line in table
            for name in re.findall(r"`([\w.]+\.py)`", line)]


def test_paper_path_imports_no_layer():
    files = paper_path()
    assert len(files) >= 6, files
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            bad = [n for n in names if n.startswith(OFF_THE_PAPER_PATH)]
            assert not bad, f"{path.name} imports off the paper path: {bad}"


def test_the_registry_lists_every_layer_file_and_its_switch():
    on_disk = {p.stem for p in (ROOT / "nano_megatron" / "layers").glob("*.py")} - {"__init__"}
    assert set(REGISTRY.modules) == on_disk == set(SWITCHES)
    assert not REGISTRY.missing, REGISTRY.missing
    classes = {layer.impl.switch: layer.impl for layer in REGISTRY.layers("engine_class")}
    assert set(classes) == set(SWITCHES.values())
    assert all(issubclass(c, MegatronEngine) for c in classes.values())
    fields = set(LayerConfig.__dataclass_fields__)
    assert fields == {*SWITCHES.values(), "performance_layers"}
    assert not fields & set(ParallelConfig.__dataclass_fields__)  # the paper path has no layer switch


CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device name: nothing is allocated


def names(cls: type) -> list[str]:
    return [c.switch for c in cls.__mro__ if "switch" in vars(c)]


def test_engine_class_stacks_asked_and_applying_layers():
    cfg = train_config()  # 4 micro-batches per rank
    assert engine_class(ParallelConfig(), cfg, CPU) is MegatronEngine  # no layer applies on a CPU
    assert names(engine_class(ParallelConfig(tp=2), cfg, CPU, LayerConfig(tp_comm_overlap=True))) == [
        "tp_comm_overlap"]
    both = engine_class(ParallelConfig(), cfg, CPU, LayerConfig(cuda_graph=True, tp_comm_overlap=True))
    assert [c.__name__ for c in both.__mro__[1:4]] == ["CUDAGraphEngine", "TPCommOverlapEngine",
                                                       "MegatronEngine"]
    # auto: where each layer was measured to help; the pairs (more memory) only when asked for
    assert names(engine_class(ParallelConfig(tp=2), cfg, CUDA)) == ["tp_comm_overlap"]
    assert names(engine_class(ParallelConfig(), cfg, CUDA)) == ["cuda_graph"]
    pairs = LayerConfig(overlap_micro_batches=True)
    assert names(engine_class(ParallelConfig(), cfg, CUDA, pairs)) == ["cuda_graph", "overlap_micro_batches"]
    assert engine_class(ParallelConfig(pp=2), cfg, CUDA) is MegatronEngine
    off = LayerConfig(cuda_graph=False)
    assert engine_class(ParallelConfig(), cfg, CUDA, off) is MegatronEngine
    # the one switch: the paper path alone, here and in every kernel shared.model calls
    paper = LayerConfig(performance_layers=False)
    assert engine_class(ParallelConfig(tp=2), cfg, CUDA, paper) is PaperPathEngine
    with performance_layers(False):
        assert engine_class(ParallelConfig(tp=2), cfg, CUDA) is PaperPathEngine
    with pytest.raises(ValueError, match="parallel.cuda_graph=true asks for a performance layer, and "
                                         "performance_layers=false runs the paper path alone"):
        engine_class(ParallelConfig(), cfg, CUDA, LayerConfig(performance_layers=False, cuda_graph=True))


def test_layer_switches_are_tri_state():
    with pytest.raises(TypeError, match="parallel.cuda_graph must be null, true or false, got 'yes'"):
        LayerConfig(cuda_graph="yes")
    with pytest.raises(TypeError, match="performance_layers must be true or false"):
        LayerConfig(performance_layers=None)
    with pytest.raises(TypeError, match="tp_comm_overlap"):
        ParallelConfig(tp_comm_overlap=True)  # a layer switch is not the paper path's


@pytest.fixture
def one_rank():
    created = not dist.is_initialized()
    init_distributed()
    yield
    if created:
        destroy_distributed()


def test_seq_len_longer_than_the_model_raises_before_any_collective(one_rank):
    with pytest.raises(ValueError, match=r"train.seq_len \(4096\) exceeds the model's "
                                         r"max_position_embeddings \(2048\)"):
        MegatronEngine(model_config(), ParallelConfig(), train_config(seq_len=4096))


def test_resume_shard_errors_name_the_file(one_rank, tmp_path):
    """A garbage resume shard is a ValueError naming it; a checkpoint of another model names the difference
    before any shard is read (shared.checkpoint.check_same_model)."""
    from shared.train import train

    mc = model_config(vocab_size=4096)  # the corpus's tokenizer
    cfg = train_config(steps=1, out_dir=str(tmp_path / "a"))
    engine = MegatronEngine(mc, ParallelConfig(), cfg)
    train(engine, cfg)
    engine.close()
    ckpt = tmp_path / "a" / "checkpoint"
    shard = ckpt / "resume" / "megatron-pp000-tp000.pt"
    shard.write_bytes(b"not a checkpoint")
    resumed = train_config(steps=2, out_dir=str(tmp_path / "b"), resume_from=str(ckpt))
    engine = MegatronEngine(mc, ParallelConfig(), resumed)
    with pytest.raises(ValueError, match=rf"'{shard}' is not a nano_megatron resume shard file: torch.load "
                                         "cannot read it"):
        train(engine, resumed)
    engine.close()
    engine = MegatronEngine(mc.replace(num_hidden_layers=3), ParallelConfig(), resumed)
    with pytest.raises(ValueError, match=rf"checkpoint '{ckpt}' holds another model than this run's "
                                         r"\(num_hidden_layers 2 in the checkpoint, 3 in this run\)"):
        train(engine, resumed)
    engine.close()


def test_layer_engines_validate_before_any_collective(one_rank):
    mc, cfg = model_config(), train_config()
    with pytest.raises(ValueError, match="parallel.cuda_graph needs a CUDA device"):
        build_engine(mc, ParallelConfig(), cfg, device="cpu", layers=LayerConfig(cuda_graph=True))
    with pytest.raises(ValueError, match=r"micro_batch_size \(4\) x dp \(1\)\) = 1 must be even"):
        build_engine(mc, ParallelConfig(), train_config(micro_batch_size=4),
                     layers=LayerConfig(overlap_micro_batches=True))
    with pytest.raises(ValueError, match="parallel.tp_comm_overlap=true needs tp > 1"):
        build_engine(mc, ParallelConfig(), cfg, layers=LayerConfig(tp_comm_overlap=True))


def test_paper_path_engine_steps_with_every_layer_off(one_rank, monkeypatch):
    seen = []

    def step(self, micro_batches, lr):
        seen.append(layers_enabled())
        return torch.zeros(()), torch.zeros(())

    monkeypatch.setattr(MegatronEngine, "_step", step)
    engine = build_engine(model_config(), ParallelConfig(), train_config(),
                          layers=LayerConfig(performance_layers=False))
    assert type(engine) is PaperPathEngine and layer_names(engine) == []
    engine.train_step([], 1e-3)
    assert seen == [False] and layers_enabled()
    engine.close()


# --------------------------------------------------------------------------- layer files deleted
LAYERS = [f"nano_megatron/layers/{m}.py" for m in REGISTRY.modules]
SCRIPT = textwrap.dedent('''
    import json, os
    import torch
    import nano_megatron
    from nano_megatron.build import REGISTRY, SWITCHES, LayerConfig, build_engine, layer_names
    from nano_megatron.engine import ParallelConfig
    from shared.config import ModelConfig
    from shared.dist import init_distributed
    from shared.train import TrainConfig, micro_batches_of

    assert nano_megatron.__file__.startswith(os.getcwd()), nano_megatron.__file__
    init_distributed()
    mc = ModelConfig.from_name("tiny").replace(**MODEL)
    cfg = TrainConfig(global_batch_size=4, micro_batch_size=1, seq_len=8)
    x = torch.randint(0, mc.vocab_size, (4, 9), generator=torch.Generator().manual_seed(0))

    def losses(layers):
        engine = build_engine(mc, ParallelConfig(), cfg, layers=layers)
        out = [engine.train_step(micro_batches_of(x[:, :-1], x[:, 1:], 1), 1e-3).loss
               for _ in range(2)]
        return layer_names(engine), out

    out = {"auto": losses(LayerConfig()), "errors": {}}
    REGISTRY.load()
    out["missing"] = sorted(REGISTRY.missing)
    for module in out["missing"]:
        try:
            build_engine(mc, ParallelConfig(), cfg, layers=LayerConfig(**{SWITCHES[module]: True}))
        except ValueError as e:
            out["errors"][module] = str(e)
    if "micro_batch_pairs" not in out["missing"]:  # a layer still present runs when asked for
        out["pairs"] = losses(LayerConfig(overlap_micro_batches=True))
    print("RESULT", json.dumps(out))
''')
MODEL = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, head_dim=8, vocab_size=97)


@pytest.fixture(scope="module")
def paper_path_losses():
    """The full repository's paper path on the same tiny training (this process, one thread)."""
    created = not dist.is_initialized()
    init_distributed()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mc = ModelConfig.from_name("tiny").replace(**MODEL)
        cfg = TrainConfig(global_batch_size=4, micro_batch_size=1, seq_len=8)
        x = torch.randint(0, mc.vocab_size, (4, 9), generator=torch.Generator().manual_seed(0))
        engine = build_engine(mc, ParallelConfig(), cfg, layers=LayerConfig(performance_layers=False))
        losses = [engine.train_step(micro_batches_of(x[:, :-1], x[:, 1:], 1), 1e-3).loss
                  for _ in range(2)]
        engine.close()
        return losses
    finally:
        torch.set_num_threads(threads)
        if created:
            destroy_distributed()


@pytest.mark.slow
@pytest.mark.parametrize("deleted", [[f] for f in LAYERS] + [LAYERS], ids=[*REGISTRY.modules, "all"])
def test_package_runs_with_every_layer_file_deleted(run_in_copy, paper_path_losses, deleted):
    proc = run_in_copy(["nano_megatron", "shared", "nano_flashattn"], deleted,
                       f"MODEL = {MODEL!r}\n" + SCRIPT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    gone = sorted(Path(f).stem for f in deleted)
    assert out["missing"] == gone
    assert out["auto"] == [[], pytest.approx(paper_path_losses, rel=1e-6)]  # on a CPU: the paper path
    for module in gone:
        assert (f"parallel.{SWITCHES[module]}=true needs the performance layer "
                f"nano_megatron.layers.{module}, which is not present") in out["errors"][module]
    if "micro_batch_pairs" not in gone:
        assert out["pairs"] == [["overlap_micro_batches"], pytest.approx(paper_path_losses, rel=1e-6)]
