"""shared.data: the embedded corpus, its token splits, and the seeded next-token batcher."""

from __future__ import annotations

import pytest
import torch

from shared.data import TokenBatches, corpus_documents, corpus_tokens, load_corpus, sequential_batches
from shared.tokenizer import EOT, EOT_ID, get_tokenizer


def test_corpus():
    text = load_corpus()
    docs = text.split(EOT)
    assert len(text.encode()) > 1_500_000 and len(docs) > 5000
    assert all(d.strip() for d in docs)
    assert len(set(docs)) == len(docs)  # deduplicated
    assert "Return" in text and "pydoc" not in docs[0]


def test_splits():
    train, val = corpus_documents("train"), corpus_documents("val")
    assert len(train) + len(val) == len(load_corpus().split(EOT))
    assert 0.04 < len(val) / (len(train) + len(val)) < 0.06
    assert not set(train) & set(val)
    enc = get_tokenizer()
    for split, docs in (("train", train), ("val", val)):
        toks = corpus_tokens(split)
        assert toks.dtype == torch.int64 and toks.dim() == 1
        assert int(toks.max()) < enc.n_vocab and int(toks.min()) >= 0
        assert int((toks == EOT_ID).sum()) == len(docs)
        assert corpus_tokens(split) is toks  # cached
    assert enc.decode(corpus_tokens("val").tolist()) == "".join(d + EOT for d in val)
    with pytest.raises(ValueError, match="split must be one of"):
        corpus_tokens("test")


def test_batches_shift_and_shapes():
    tokens = torch.arange(1000) * 3
    batches = TokenBatches(tokens, batch_size=5, seq_len=16, seed=3)
    for _ in range(4):
        starts = batches.global_starts(batches.step)
        x, y = batches.next_batch()
        assert x.shape == y.shape == (5, 16) and x.dtype == y.dtype == torch.int64
        assert x.is_contiguous() and y.is_contiguous()
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert torch.equal(x, tokens[starts[:, None] + torch.arange(16)])
        assert torch.equal(y[:, -1], tokens[starts + 16])  # the last target exists: no overrun
    tiny = TokenBatches(torch.arange(5), batch_size=64, seq_len=4)
    x, y = tiny.next_batch()
    assert torch.equal(x, torch.arange(4).expand(64, 4)) and torch.equal(y, torch.arange(1, 5).expand(64, 4))


def test_deterministic_under_seed():
    tokens = corpus_tokens("train")
    a = TokenBatches(tokens, 4, 32, seed=7)
    b = TokenBatches(tokens, 4, 32, seed=7)
    c = TokenBatches(tokens, 4, 32, seed=8)
    for _ in range(3):
        xa, ya = next(a)
        xb, yb = next(b)
        xc, _ = next(c)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert not torch.equal(xa, xc)
    # pinned: same seed => same windows on every machine and torch version (resumed runs rely on it)
    pinned = TokenBatches(torch.arange(1000), 2, 4, seed=0)
    assert pinned.global_starts(0).tolist() == [321, 498]
    assert pinned.global_starts(1).tolist() == [558, 574]


def test_data_parallel_ranks_split_the_single_process_batch():
    tokens = corpus_tokens("train")
    world, per_rank = 4, 3
    single = TokenBatches(tokens, per_rank * world, 24, seed=11)
    ranks = [TokenBatches(tokens, per_rank, 24, seed=11, rank=r, world_size=world) for r in range(world)]
    for _ in range(3):
        x, y = single.next_batch()
        parts = [b.next_batch() for b in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)
        assert all(b.global_batch_size == single.batch_size for b in ranks)


def test_state_dict_resume():
    tokens = corpus_tokens("val")
    run = TokenBatches(tokens, 4, 8, seed=5)
    for _ in range(5):
        run.next_batch()
    state = run.state_dict()
    expected = [run.next_batch() for _ in range(3)]

    resumed = TokenBatches(tokens, 4, 8, seed=0)  # seed comes from the state
    resumed.load_state_dict(state)
    for x, y in expected:
        rx, ry = resumed.next_batch()
        assert torch.equal(rx, x) and torch.equal(ry, y)

    # resume on 2 ranks with the same global batch: the ranks' rows still make up the same batch
    halves = [TokenBatches(tokens, 2, 8, rank=r, world_size=2) for r in range(2)]
    for h in halves:
        h.load_state_dict(state)
    for x, _ in expected:
        assert torch.equal(torch.cat([h.next_batch()[0] for h in halves]), x)

    with pytest.raises(ValueError, match="seq_len=8, but this TokenBatches has 9"):
        TokenBatches(tokens, 4, 9).load_state_dict(state)
    with pytest.raises(ValueError, match="global_batch_size=4, but this TokenBatches has 8"):
        TokenBatches(tokens, 8, 8).load_state_dict(state)
    with pytest.raises(ValueError, match="num_tokens"):
        TokenBatches(tokens[:-1], 4, 8).load_state_dict(state)
    with pytest.raises(ValueError, match=r"missing \['step'\]"):
        TokenBatches(tokens, 4, 8).load_state_dict({k: v for k, v in state.items() if k != "step"})


def test_bad_arguments():
    tokens = torch.arange(100)
    with pytest.raises(ValueError, match=r"seq_len \(100\) must be < len\(tokens\) \(100\)"):
        TokenBatches(tokens, 2, 100)
    for bs in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="batch_size must be a positive int"):
            TokenBatches(tokens, bs, 8)
    with pytest.raises(ValueError, match="seq_len must be a positive int"):
        TokenBatches(tokens, 2, 0)
    for rank, world in ((2, 2), (-1, 2), (0.0, 1)):
        with pytest.raises(ValueError, match=r"rank must be an int in \[0, world_size="):
            TokenBatches(tokens, 2, 8, rank=rank, world_size=world)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        TokenBatches(tokens, 2, 8, world_size=0)
    with pytest.raises(ValueError, match="tokens must be a 1-D integer tensor"):
        TokenBatches(tokens.view(10, 10), 2, 8)
    with pytest.raises(ValueError, match="tokens must be a 1-D integer tensor"):
        TokenBatches(tokens.float(), 2, 8)
    with pytest.raises(TypeError, match="seed must be an int"):
        TokenBatches(tokens, 2, 8, seed="0")
    with pytest.raises(ValueError, match="split must be one of"):
        TokenBatches.from_corpus("validation")


def test_from_corpus_and_sequential_batches():
    x, y = TokenBatches.from_corpus("val", batch_size=2, seq_len=64, seed=1).next_batch()
    assert x.shape == y.shape == (2, 64)
    tokens = torch.arange(103)
    full = list(sequential_batches(tokens, batch_size=4, seq_len=10))
    xs = torch.cat([b[0] for b in full])
    assert xs.shape == (10, 10) and [b[0].shape[0] for b in full] == [4, 4, 2]
    assert torch.equal(xs.flatten(), torch.arange(100))
    assert torch.equal(torch.cat([b[1] for b in full]).flatten(), torch.arange(1, 101))
    per_rank = [torch.cat([b[0] for b in sequential_batches(tokens, 4, 10, rank=r, world_size=3)])
                for r in range(3)]
    assert sorted(int(w[0]) for p in per_rank for w in p) == list(range(0, 100, 10))
    with pytest.raises(ValueError, match="rank must be"):
        next(sequential_batches(tokens, 4, 10, rank=3, world_size=3))


# ------------------------------------------------------------------ the stdlib source corpus
# CI never tokenizes the whole stdlib (~10M tokens): these tests build a small stand-in tree.

def _small_stdlib(root):
    """A few dozen modules, one package, a non-UTF-8 file, and directories the corpus must skip."""
    from shared.data import stdlib_split

    (root / "pkg").mkdir(parents=True)
    for i in range(40):
        (root / f"mod_{i:02d}.py").write_text(f'"""Module {i}."""\n\ndef f_{i}(x):\n    return x * {i}\n')
    (root / "pkg" / "__init__.py").write_text("from .core import *\n")
    (root / "pkg" / "core.py").write_text("# -*- coding: latin-1 -*-\nNAME = 'caf\xe9'\n", encoding="latin-1")
    (root / "notes.txt").write_text("not python")
    for skipped in ("site-packages", "__pycache__", "config-3.11-x86_64-linux-gnu"):
        (root / skipped).mkdir()
        (root / skipped / "skipped.py").write_text("SKIPPED = True\n")
    splits = {stdlib_split(p.relative_to(root).as_posix()) for p in root.rglob("mod_*.py")}
    assert splits == {"train", "val"}, "the stand-in tree needs files in both splits"
    return root


def test_stdlib_files_and_split(tmp_path):
    from shared.data import read_source, stdlib_files, stdlib_root, stdlib_split

    root = _small_stdlib(tmp_path / "lib")
    files = stdlib_files(root)
    assert files == sorted(files) and len(files) == 42
    assert "pkg/core.py" in files and not any("skipped" in f for f in files)
    assert read_source(root / "pkg" / "core.py") == "# -*- coding: latin-1 -*-\nNAME = 'caf\xe9'\n"
    (root / "bad.py").write_bytes(b"# -*- coding: no-such-codec -*-\nx = '\xff'\n")
    assert "\ufffd" in read_source(root / "bad.py")  # undecodable: replacement characters, no error
    # the real stdlib: ~5% of the modules held out, the same rule on every machine
    real = stdlib_files()
    val = [f for f in real if stdlib_split(f) == "val"]
    assert len(real) > 500 and 0.03 < len(val) / len(real) < 0.07
    assert stdlib_root().is_dir() and stdlib_split("json/decoder.py") == stdlib_split("json/decoder.py")
    with pytest.raises(FileNotFoundError, match="stdlib root .*nowhere.* is not a directory"):
        stdlib_files(tmp_path / "nowhere")


def test_stdlib_tokens_decode_and_cache(tmp_path, monkeypatch):
    import shared.data as data

    root, cache = _small_stdlib(tmp_path / "lib"), tmp_path / "cache"
    enc = get_tokenizer()
    files = data.stdlib_files(root)
    for split in ("train", "val"):
        toks = data.stdlib_tokens(split, root=root, cache_dir=cache, workers=2)
        docs = [data.read_source(root / f) for f in files if data.stdlib_split(f) == split]
        assert toks.dtype == torch.int64 and int((toks == EOT_ID).sum()) == len(docs)
        assert enc.decode(toks.tolist()) == "".join(d + EOT for d in docs)  # file order, EOT after each
    [cached] = list(cache.glob("stdlib-*.npz"))
    assert not list(cache.glob("*.tmp"))  # written beside, then renamed over: no partial file remains
    train = data.stdlib_tokens("train", root=root, cache_dir=cache)

    # a fresh process (empty in-memory cache) reads the file instead of tokenizing again
    monkeypatch.setattr(data, "_STDLIB", {})
    monkeypatch.setattr(data, "_tokenize_stdlib", lambda *a: pytest.fail("tokenized although cached"))
    assert torch.equal(data.stdlib_tokens("train", root=root, cache_dir=cache), train)
    monkeypatch.undo()

    # an edited module changes the key: re-tokenized, the old cache file is left alone
    (root / "mod_00.py").write_text("changed = 1\n")
    data.stdlib_tokens("train", root=root, cache_dir=cache)
    assert len(list(cache.glob("stdlib-*.npz"))) == 2 and cached.exists()
    # a damaged cache file is rebuilt, not trusted
    monkeypatch.setattr(data, "_STDLIB", {})
    for f in cache.glob("stdlib-*.npz"):
        f.write_bytes(b"not an npz")
    assert data.stdlib_tokens("val", root=root, cache_dir=cache).numel() > 0

    with pytest.raises(ValueError, match="has no .py files"):
        data.stdlib_tokens("train", root=tmp_path / "cache", cache_dir=cache)
    with pytest.raises(ValueError, match="split must be one of"):
        data.stdlib_tokens("test", root=root, cache_dir=cache)


def test_corpus_option_routes_to_stdlib(tmp_path, monkeypatch):
    import shared.data as data

    root = _small_stdlib(tmp_path / "lib")
    monkeypatch.setattr(data, "stdlib_root", lambda: root)
    monkeypatch.setattr(data, "default_cache_dir", lambda: tmp_path / "cache")
    x, y = TokenBatches.from_corpus("train", batch_size=2, seq_len=8, corpus="stdlib").next_batch()
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(corpus_tokens("val", corpus="stdlib"), data.stdlib_tokens("val", root=root))
    with pytest.raises(ValueError, match=r"corpus must be one of \('docs', 'stdlib'\), got 'pypi'"):
        corpus_tokens("train", corpus="pypi")
    with pytest.raises(ValueError, match="corpus must be one of"):
        TokenBatches.from_corpus("train", corpus="pypi")


def test_training_reads_the_configured_corpus(monkeypatch):
    """`train.corpus=stdlib` (TrainConfig.corpus) is what nano_megatron.train and shared.train draw from."""
    import shared.data as data
    from shared.config import ModelConfig
    from shared.train import LocalEngine, TrainConfig, train

    class Drawn(Exception):
        pass

    def from_corpus(cls, *args, **kwargs):
        raise Drawn(kwargs["corpus"])

    monkeypatch.setattr(data.TokenBatches, "from_corpus", classmethod(from_corpus))
    cfg = TrainConfig(steps=1, global_batch_size=2, micro_batch_size=2, seq_len=8, corpus="stdlib")
    with pytest.raises(Drawn, match="stdlib"):
        train(LocalEngine(ModelConfig.from_name("tiny").replace(num_hidden_layers=1), cfg), cfg)
    assert TrainConfig().corpus == "docs"
