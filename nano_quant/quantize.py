"""Quantize a checkpoint with one method and write it as an HF directory:

    python -m nano_quant.quantize model=DIR method=awq out=DIR
    python -m nano_quant.quantize model=DIR method=smoothquant alpha=0.5 out=DIR calibration.n_samples=128

`method` is one of awq, rtn-w4, smoothquant, naive-w8a8, smoothquant-fp8, naive-fp8. The float model is
calibrated in fp32 on `calibration.n_samples` × `calibration.seq_len` tokens of the corpus' training split
(AWQ's 128 × 512), quantized in place (`nano_quant.methods.quantize_model`, tqdm over the layers) and saved
with `quantization_config` in config.json (AutoAWQ's GEMM layout for awq and rtn-w4);
`python -m nano_quant.perplexity model=OUT` then measures it.
"""

from __future__ import annotations

import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from shared.checkpoint import load_model
from shared.hydra_utils import to_dataclass

from .awq import AWQConfig
from .calibration import calibration_samples
from .checkpoint import save_quantized
from .config import METHODS, QuantizationConfig
from .methods import CALIBRATED, quantize_model
from .perplexity import resolve_device, resolve_dtype


def quantize_checkpoint(model_dir: str | Path, method: str, out: str | Path, cfg: DictConfig) -> dict:
    """Load `model_dir`, quantize it with `method`, save to `out`; returns a summary row."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {method!r}")
    device = resolve_device(cfg.device)
    model = load_model(model_dir, device=device, dtype=torch.float32)
    cal = cfg.calibration
    samples = None
    if method in CALIBRATED:
        samples = calibration_samples(int(cal.n_samples), int(cal.seq_len), str(cal.corpus), int(cal.seed))
    awq = to_dataclass(AWQConfig, cfg.awq, group_size=int(cfg.group_size))
    t0 = time.perf_counter()
    config = {"group_size": int(cfg.group_size)} if METHODS[method]["quant_method"] == "awq" else {}
    qcfg: QuantizationConfig = quantize_model(model, method, samples, float(cfg.alpha), awq, **config)
    seconds = time.perf_counter() - t0
    path = save_quantized(model, out, qcfg, dtype=resolve_dtype(str(cfg.save_dtype)))
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"{method}: quantized {model_dir} in {seconds:.1f}s -> {path} ({size / 1e6:.1f} MB), "
          f"quantization_config {qcfg.to_dict()}", flush=True)
    return {"method": method, "out": str(path), "seconds": seconds, "bytes": size, **qcfg.to_dict()}


def run(cfg: DictConfig) -> dict:
    """Everything `main` does, callable without Hydra (tests)."""
    for key in ("model", "out"):
        if not cfg.get(key):
            raise ValueError(f"{key}=DIR is required (model: the float checkpoint, out: where to write)")
    return quantize_checkpoint(str(cfg.model), str(cfg.method), str(cfg.out), cfg)


@hydra.main(version_base=None, config_path="configs", config_name="quantize")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
