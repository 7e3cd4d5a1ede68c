"""shared.checkpoint under faults: corrupt or truncated files raise errors that name them, and a save that
is killed half-way leaves a checkpoint that still loads (every file is replaced atomically)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import shared.checkpoint as checkpoint
from shared.checkpoint import INDEX_NAME, SINGLE_NAME, load_model, load_state_dict, save_checkpoint
from shared.config import ModelConfig, resolve_model_config
from shared.model import build_model

TINY = ModelConfig.from_name("tiny").replace(num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                                             head_dim=16)


def _saved(tmp_path, seed: int = 0, **kw):
    model = build_model(TINY, seed=seed)
    return model, save_checkpoint(model, TINY, tmp_path / "ckpt", **kw)


def _equal(model, path) -> bool:
    loaded = load_state_dict(path)
    return all(torch.equal(loaded[k], v) for k, v in model.state_dict().items() if k in loaded)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_safetensors_names_the_file(tmp_path, damage):
    _, ckpt = _saved(tmp_path)
    f = ckpt / SINGLE_NAME
    data = f.read_bytes()
    f.write_bytes({"garbage": b"\xff" * 1000, "truncated": data[:1000], "empty": b""}[damage])
    for load in (load_model, load_state_dict):
        with pytest.raises(ValueError, match="not a readable safetensors file") as info:
            load(ckpt)
        assert str(f) in str(info.value)


def test_bad_config_json_names_the_file(tmp_path):
    _, ckpt = _saved(tmp_path)
    config = ckpt / "config.json"
    config.write_text('{"model_type": "qwen3", "hidden_size": ')  # cut short
    with pytest.raises(ValueError, match="not valid JSON") as info:
        load_model(ckpt)
    assert str(config) in str(info.value)
    for path in (ckpt, config):  # the path every engine resolves a checkpoint's config through
        with pytest.raises(ValueError, match="not valid JSON") as info:
            resolve_model_config(str(path))
        assert str(config) in str(info.value)
    config.write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a JSON list, not an object"):
        load_model(ckpt)
    config.write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unknown architecture") as info:
        load_model(ckpt)
    assert str(config) in str(info.value)


def test_bad_index_names_the_file(tmp_path):
    _, ckpt = _saved(tmp_path, max_shard_size=100_000)
    index = ckpt / INDEX_NAME
    index.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON") as info:
        load_state_dict(ckpt)
    assert str(index) in str(info.value)
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="has no 'weight_map' object"):
        load_state_dict(ckpt)


@pytest.mark.parametrize("shard_size", ["2GB", 100_000])
def test_save_killed_half_way_leaves_the_previous_checkpoint(tmp_path, monkeypatch, shard_size):
    """The writer dies after half a file (a kill, a full disk): the directory must still load, with the
    weights of the last complete save."""
    old, ckpt = _saved(tmp_path, seed=0, max_shard_size=shard_size)
    real = checkpoint.save_file

    def dies_half_way(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        with open(filename, "rb+") as f:
            f.truncate(os.path.getsize(filename) // 2)
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(checkpoint, "save_file", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(build_model(TINY, seed=1), TINY, ckpt, max_shard_size=shard_size)
    monkeypatch.undo()
    assert _equal(old, ckpt)
    load_model(ckpt)
    assert not [p.name for p in ckpt.iterdir() if p.name.endswith(".tmp")]


def test_overwrite_between_single_and_sharded_layouts(tmp_path):
    _, ckpt = _saved(tmp_path)
    new = build_model(TINY, seed=1)
    save_checkpoint(new, TINY, ckpt, max_shard_size=100_000)  # single file -> shards
    assert (ckpt / INDEX_NAME).is_file() and not (ckpt / SINGLE_NAME).exists()
    assert _equal(new, ckpt)
    newest = build_model(TINY, seed=2)
    save_checkpoint(newest, TINY, ckpt)  # shards -> single file: no stale shard or index left
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", SINGLE_NAME]
    assert _equal(newest, ckpt)
    (ckpt / ".model.safetensors.tmp").write_bytes(b"left by a killed save")
    save_checkpoint(newest, TINY, ckpt)
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", SINGLE_NAME]
