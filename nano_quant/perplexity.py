"""Held-out perplexity of a checkpoint, float or quantized:

    python -m nano_quant.perplexity model=DIR corpus=stdlib split=val seq_len=512 dtype=bf16

Perplexity is exp of the mean next-token cross-entropy over every non-overlapping `seq_len` window of the
split (`shared.data.sequential_batches`), the way both papers report WikiText-2 perplexity. The stdlib
corpus' "val" split is the held-out modules, never seen in training or calibration. A checkpoint with a
`quantization_config` (ours or AutoAWQ's) runs through the quantized layers and, on CUDA, the Triton kernels.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import hydra
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from nano_flashattn.registry import performance_layers
from shared.bench import print_table, write_json
from shared.data import corpus_tokens, sequential_batches
from shared.hydra_utils import hydra_run_dir
from shared.model import CausalLM

from .checkpoint import load_quantized_model, quantization_config_of

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@torch.no_grad()
def perplexity(model: CausalLM, tokens: torch.Tensor, seq_len: int = 512, batch_size: int = 16,
               progress: bool = False) -> dict[str, float]:
    """exp(mean NLL) of `model` over every non-overlapping window of `tokens`; also the NLL and the count."""
    dev = next(model.parameters()).device
    nll, count = 0.0, 0
    windows = (tokens.numel() - 1) // seq_len
    for x, y in tqdm(sequential_batches(tokens, batch_size, seq_len), total=math.ceil(windows / batch_size),
                     desc="perplexity", disable=not progress):
        logits = model(x.to(dev))
        nll += float(F.cross_entropy(logits.float().flatten(0, 1), y.to(dev).flatten(), reduction="sum"))
        count += y.numel()
    return {"ppl": math.exp(nll / count), "nll": nll / count, "tokens": count}


def resolve_device(device: str | None) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def config_record(cfg: DictConfig) -> dict:
    """The run's config as plain data for its JSON record (Hydra's own node left out)."""
    return OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True)


def run(cfg: DictConfig) -> dict:
    """Everything `main` does, callable without Hydra (tests); `performance_layers=false`: the
    paper path's torch references alone."""
    with performance_layers(cfg.get("performance_layers", True)):
        if not cfg.get("model"):
            raise ValueError("model=DIR is required: a checkpoint directory (float or quantized)")
        path = Path(str(cfg.model))
        device, dtype = resolve_device(cfg.device), resolve_dtype(str(cfg.dtype))
        qcfg = quantization_config_of(path)
        model = load_quantized_model(path, device, dtype).eval()
        tokens = corpus_tokens(str(cfg.split), corpus=str(cfg.corpus))
        if cfg.max_tokens:
            tokens = tokens[: int(cfg.max_tokens) + 1]
        t0 = time.perf_counter()
        result = perplexity(model, tokens, int(cfg.seq_len), int(cfg.batch_size), progress=True)
        row = {"model": str(path), "quantization": qcfg.to_dict() if qcfg else None, "corpus": str(cfg.corpus),
               "split": str(cfg.split), "seq_len": int(cfg.seq_len), "dtype": str(cfg.dtype), **result,
               "seconds": time.perf_counter() - t0}
        print_table([{k: v for k, v in row.items() if k != "quantization"}], title="held-out perplexity")
        write_json(Path(hydra_run_dir()) / "perplexity.json", row)
        return row


@hydra.main(version_base=None, config_path="configs", config_name="perplexity")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
