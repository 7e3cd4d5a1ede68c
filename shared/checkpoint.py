"""Hugging Face-format checkpoints: a directory with `config.json` and `*.safetensors`.

Because shared.model uses HF's parameter names, loading is "read every tensor, check its name and shape,
assign it"; saving is the reverse plus a `config.json` that `transformers` understands. Large models are
split into shards with a `model.safetensors.index.json` (HF's layout), so what nano_megatron and nano_zero
save loads in `transformers`, in nano_vllm, and back here.

Every file is written under a temporary name in the same directory, fsynced and renamed over the old one,
in an order that keeps the directory loadable at every instant: a save killed half-way leaves the previous
checkpoint (or the new one), never a truncated file. config.json goes last, written once with everything
it says (a caller's additions such as a `quantization_config` included); a save whose config.json differs
from the one in place removes that one first, so a kill leaves no config.json (an error naming the
directory) rather than new tensors under a config that does not describe them. A corrupt or truncated
file raises an error that names it; so does a resume file that torch cannot read, and a resume checkpoint of another model.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import safetensors
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shared.config import ModelConfig
from shared.dist import barrier, get_rank
from shared.model import CausalLM

if TYPE_CHECKING:
    from shared.data import TokenBatches

CHECKPOINT_DIR = "checkpoint"  # under a run's out_dir: the consolidated HF checkpoint
RESUME_DIR = "resume"  # under the checkpoint: engine shards + loop state
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Tensors some HF checkpoints carry that are recomputed here, never learned.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_SAFETENSORS_ERRORS = (getattr(safetensors, "SafetensorError", OSError), OSError, ValueError)
# The ModelConfig fields that decide which tensors a model has and their shapes: a resume checkpoint must
# agree on all of them (rope_theta or max_position_embeddings may change between runs, e.g. to extend context).
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "tie_word_embeddings", "attention_bias", "qk_norm")


def read_json(path: str | os.PathLike) -> dict[str, Any]:
    """A JSON object from a checkpoint file (config.json, the shard index), with a ValueError naming the
    file when it is not one."""
    try:
        with open(path) as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{str(path)!r} is not valid JSON ({e}): a corrupt or truncated checkpoint file") from e
    if not isinstance(value, dict):
        raise ValueError(f"{str(path)!r} holds a JSON {type(value).__name__}, not an object")
    return value


def read_config(path: str | os.PathLike) -> ModelConfig:
    """`ModelConfig.from_hf` of a checkpoint directory's config.json; errors name the file."""
    config = Path(path) / "config.json"
    try:
        return ModelConfig.from_hf(read_json(config))
    except ValueError as e:
        if str(config) in str(e):
            raise
        raise ValueError(f"{str(config)!r}: {e}") from e


def _checkpoint_dir(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(p)!r} does not exist")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"checkpoint directory {str(p)!r} has no config.json")
    return p


def _safetensors_files(p: Path) -> list[Path]:
    if (p / INDEX_NAME).is_file():
        weight_map = read_json(p / INDEX_NAME).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{str(p / INDEX_NAME)!r} has no 'weight_map' object")
        files = [p / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"checkpoint directory {str(p)!r} has no *.safetensors files")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint shard {str(f)!r} named in {INDEX_NAME} is missing")
    return files


def load_state_dict(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, by name (sharded or not)."""
    p = _checkpoint_dir(path)
    out: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(p):
        try:
            with safe_open(str(file), framework="pt", device=str(device)) as f:
                for name in f.keys():
                    out[name] = f.get_tensor(name)
        except _SAFETENSORS_ERRORS as e:
            raise ValueError(f"{str(file)!r} is not a readable safetensors file ({type(e).__name__}: {e}): "
                             "a corrupt or truncated checkpoint shard") from e
    return out


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> CausalLM:
    """Build shared.model from an HF checkpoint directory (Llama, Qwen2, Qwen3) and load its weights.

    Raises FileNotFoundError (no directory / config / weights), ValueError (unknown architecture, a
    missing or unexpected tensor, a tensor of the wrong shape), each naming the offending item.
    """
    p = _checkpoint_dir(path)
    cfg = read_config(p)
    with torch.device("meta"):
        model = CausalLM(cfg)
    expected = {name: t.shape for name, t in model.state_dict().items()}
    tied = cfg.tie_word_embeddings
    state = {k: v for k, v in load_state_dict(p).items() if not k.endswith(_IGNORED_SUFFIXES)}
    if tied:  # a tied checkpoint stores the embedding once; the head shares it
        state.pop("lm_head.weight", None)
        expected.pop("lm_head.weight")
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"checkpoint {str(p)!r} is missing tensor(s) {missing[:5]}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ValueError(f"checkpoint {str(p)!r} has unexpected tensor(s) {unexpected[:5]} "
                         f"for a {cfg.model_type} model")
    for name, shape in expected.items():
        if tuple(state[name].shape) != tuple(shape):
            raise ValueError(f"tensor {name!r} in {str(p)!r} has shape {tuple(state[name].shape)}, "
                             f"expected {tuple(shape)} from config.json")
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)  # assign: keep the loaded storage, no copy
    model.tie_weights()
    return model


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    s = size.strip().upper()
    for unit, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


def save_checkpoint(model: CausalLM | dict[str, torch.Tensor], cfg: ModelConfig, path: str | os.PathLike,
                    max_shard_size: int | str = "2GB", dtype: torch.dtype | None = None,
                    config_extra: dict[str, Any] | None = None) -> Path:
    """Write `config.json` + safetensors shards (with HF's index file when there is more than one).

    `model` may be a CausalLM or a consolidated state dict (what the parallel trainers gather on rank 0).
    `config_extra` is merged into config.json (e.g. a `quantization_config` and the float dtype of a
    quantized model). Overwriting a checkpoint is safe against a kill at any instant (module docstring).
    """
    state = model.state_dict() if isinstance(model, torch.nn.Module) else dict(model)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    limit = _parse_size(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        t = t.detach().to("cpu", dtype=dtype or t.dtype).contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    names = ([SINGLE_NAME] if len(shards) == 1
             else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for stale in p.glob(".*.tmp"):  # left by a save that was killed
        stale.unlink()
    hf = cfg.to_hf()
    first = next(iter(state.values()))
    hf["torch_dtype"] = hf["dtype"] = str(dtype or first.dtype).removeprefix("torch.")
    hf.update(config_extra or {})
    config = p / "config.json"
    if config.is_file() and _json_or_none(config) != json.loads(json.dumps(hf)):
        config.unlink()  # its tensors are about to be replaced by ones it does not describe
        _fsync_dir(p)
    # New shards first (a single file replaces the old one in one rename), then the index that names
    # them (or its removal), then config.json, and only then the old shards nobody names any more.
    for name, shard in zip(names, shards):
        _write_atomic(p / name, lambda tmp, shard=shard: save_file(shard, tmp, metadata={"format": "pt"}))
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: name for name, shard in zip(names, shards) for k in shard}}
        _write_atomic(p / INDEX_NAME, lambda tmp: Path(tmp).write_text(json.dumps(index, indent=2)))
    else:
        (p / INDEX_NAME).unlink(missing_ok=True)
    _write_atomic(config, lambda tmp: Path(tmp).write_text(json.dumps(hf, indent=2)))
    for old in p.glob("*.safetensors"):  # never leave a stale shard that a loader would pick up
        if old.name not in names:
            old.unlink()
    _fsync_dir(p)
    return p


def _json_or_none(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_atomic(path: Path, write: Callable[[str], Any]) -> None:
    """`write(tmp)` to a temporary name beside `path`, fsync it, rename it over `path`: readers (and a
    kill at any instant) see the old file or the new one, never part of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(str(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _fsync_dir(path: Path) -> None:
    """Make the renames inside `path` durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------
# A training run's checkpoint: the consolidated HF directory above for users (from rank 0), and
# beside it every rank's engine shards + loop state for resuming (shared.train drives both).


class ResumableEngine(Protocol):
    """What a training checkpoint needs of an engine (shared.train.TrainEngine is one)."""

    model_config: ModelConfig

    def consolidated_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full HF-named weights on the global rank 0, None elsewhere (a collective: call on all ranks)."""
        ...

    def save_resume_state(self, directory: Path) -> None:
        """Each rank writes its own shard(s) of weights and optimizer state into `directory`."""
        ...

    def load_resume_state(self, directory: Path) -> None: ...


def _loop_state_file(directory: Path, rank: int) -> Path:
    return directory / f"loop-rank{rank:05d}.pt"


def save_training_checkpoint(engine: ResumableEngine, out_dir: str | os.PathLike, run_config: dict,
                             step: int, data: TokenBatches, is_main: bool) -> Path:
    """Write `out_dir/checkpoint` (HF format, from rank 0) and `out_dir/checkpoint/resume` (every rank);
    `run_config` (the run's TrainConfig as a dict) is kept in each loop state.

    The resume directory is written next to the old one and swapped in only when every rank is done, so
    a job killed mid-save still has the previous resume point; every file of the HF checkpoint is
    replaced atomically (`shared.checkpoint.save_checkpoint`). Collective: call on every rank.
    """
    ckpt = Path(out_dir) / CHECKPOINT_DIR
    tmp, final = ckpt / (RESUME_DIR + ".tmp"), ckpt / RESUME_DIR
    state = engine.consolidated_state_dict()
    if is_main:
        if state is None:
            raise RuntimeError("consolidated_state_dict() returned None on the main rank")
        save_checkpoint(state, engine.model_config, ckpt)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    engine.save_resume_state(tmp)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save({"step": step, "data": data.state_dict(), "rng": rng, "config": run_config},
               _loop_state_file(tmp, get_rank()))
    barrier()
    if is_main:  # two renames: at every instant `resume` or `resume.old` is a complete resume point
        old = ckpt / (RESUME_DIR + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    barrier()
    return ckpt


def resume_directory(path: str | os.PathLike) -> Path:
    """Accept either the checkpoint directory or its `resume/` subdirectory."""
    p = Path(path)
    for name in (RESUME_DIR, RESUME_DIR + ".old"):  # .old: a save was killed between its two renames
        if (p / name).is_dir():
            p = p / name
            break
    if not _loop_state_file(p, 0).is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a resume checkpoint (no {_loop_state_file(p, 0).name})")
    return p


def load_resume_file(path: str | os.PathLike, keys: tuple[str, ...], what: str,
                     map_location: str | torch.device | None = None) -> dict[str, Any]:
    """`torch.load` (weights only) of one file of a resume directory, which must hold a dict with `keys`.

    A file torch cannot read (garbage, truncated, another format) or one without those keys is a
    ValueError naming the file and saying it is not a `what` file (torch's own error is chained)."""
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except OSError:  # unreadable or missing: the OS error names the file already
        raise
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, EOFError, KeyError... by content
        raise ValueError(f"{str(path)!r} is not a {what} file: torch.load cannot read it "
                         f"({type(e).__name__}): a corrupt, truncated or foreign file") from e
    missing = [k for k in keys if not isinstance(state, dict) or k not in state]
    if missing:
        held = f"a dict without {missing}" if isinstance(state, dict) else f"a {type(state).__name__}"
        raise ValueError(f"{str(path)!r} is not a {what} file: it holds {held}")
    return state


def check_same_model(path: str | os.PathLike, model_config: ModelConfig,
                     argument: str = "train.resume_from") -> None:
    """ValueError unless the checkpoint directory's config.json describes a model of `model_config`'s
    shape (`SHAPE_FIELDS`); the message names the directory and every field that differs."""
    saved = read_config(path)
    diff = [f"{name} {getattr(saved, name)!r} in the checkpoint, {getattr(model_config, name)!r} in this run"
            for name in SHAPE_FIELDS if getattr(saved, name) != getattr(model_config, name)]
    if diff:
        raise ValueError(f"{argument}: checkpoint {str(path)!r} holds another model than this run's "
                         f"({'; '.join(diff)}): resume with the model it was trained with (its config.json)")


def load_training_checkpoint(engine: ResumableEngine, path: str | os.PathLike, data: TokenBatches
                             ) -> int:
    """Restore the engine, the data stream and the RNG; return the step to continue from.

    Checks first that the checkpoint holds a model of the engine's shape (`check_same_model`, against
    the config.json beside the resume directory) and that the loop state is one (`load_resume_file`)."""
    directory = resume_directory(path)
    if (directory.parent / "config.json").is_file():
        check_same_model(directory.parent, engine.model_config)
    own = _loop_state_file(directory, get_rank())
    loop = load_resume_file(own if own.is_file() else _loop_state_file(directory, 0),
                            ("step", "data", "rng"), "loop-state")
    engine.load_resume_state(directory)
    data.load_state_dict(loop["data"])
    torch.set_rng_state(loop["rng"]["cpu"])
    if "cuda" in loop["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(loop["rng"]["cuda"])
    return int(loop["step"])
