"""Quantization quality in one run: every method on one trained checkpoint, held-out perplexity, outliers.

    python -m nano_quant.quality model=outputs/llama-100m/checkpoint

(the checkpoint from the training command in nano_quant/README.md).

For the checkpoint: the bf16 perplexity on the held-out stdlib modules; the activation outlier statistic of
SmoothQuant §3 (max / median over input channels of max|X_j|, per projection, from the calibration run);
then each method quantizes a fresh fp32 copy (calibrated on 128 × 512 training tokens), saves it, reloads
it in bf16 and measures the same perplexity through the quantized layers. With `fp32_eval` the weight-only
rows (and the float model) are measured once more in fp32 with the exact dequantized weights
(`checkpoint.dequantize_model`): there RTN and AWQ differ by their weights alone, without the bf16 rounding
of activations (and of the dequantized weights) on top, which matters when the W4 gap is under 1%. The summary
gives the targets: AWQ's share of the RTN → bf16 gap closed (also in fp32), SmoothQuant W8A8 vs bf16 and vs
naive W8A8. A synthetic case with injected outlier channels (the paper's setting) is measured too, so the
mechanism is visible whether or not the trained model has outliers.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from nano_flashattn.registry import performance_layers
from shared.bench import print_table, release_memory, write_json
from shared.checkpoint import load_model
from shared.data import corpus_tokens
from shared.hydra_utils import hydra_run_dir

from .awq import AWQConfig, search_scale
from .calibration import calibration_samples, input_stats
from .checkpoint import dequantize_model, load_quantized_model, quantization_config_of, save_quantized
from .config import METHODS
from .methods import quantize_model
from .perplexity import config_record, perplexity, resolve_device
from .quant import fake_quantize_groupwise, quantize_rowwise
from .smoothquant import smoothing_factors

PROJECTIONS = ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")


def outlier_table(stats: dict) -> list[dict]:
    """Per projection input: the outlier ratio max_j / median_j of max|X_j| over the layers (max, median)."""
    rows = []
    for proj in PROJECTIONS:
        ratios = [s.outlier_ratio() for name, s in stats.items() if name.endswith(proj)]
        peak = max((s.absmax.max().item() for name, s in stats.items() if name.endswith(proj)), default=0.0)
        rows.append({"input of": proj.split(".")[-1] + (" (= k, v)" if proj.endswith("q_proj") else ""),
                     "max/median, worst layer": max(ratios),
                     "max/median, median layer": statistics.median(ratios), "largest |X|": peak})
    return rows


@torch.no_grad()
def synthetic_outliers(tokens: int = 2048, k: int = 1024, n: int = 1024, outlier_frac: float = 0.01,
                       magnitude: float = 50.0, seed: int = 0,
                       device: str | torch.device = "cpu") -> list[dict]:
    """The papers' setting on one Linear: X ~ N(0, 1) with `outlier_frac` of the input channels scaled by
    `magnitude`, W ~ N(0, 0.02). Relative output error ‖Ŷ − Y‖ / ‖Y‖ of naive W8A8 vs SmoothQuant
    (α = 0.5), and of RTN W4 g128 vs AWQ's scale search."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, k, generator=gen)
    x[:, torch.randperm(k, generator=gen)[: max(1, int(outlier_frac * k))]] *= magnitude
    w = torch.randn(n, k, generator=gen) * 0.02
    x, w = x.to(device), w.to(device)
    y = x @ w.t()

    def err(y_hat: torch.Tensor) -> float:
        return float((y_hat - y).norm() / y.norm())

    def w8a8(xs: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
        (qx, sx), (qw, sw) = quantize_rowwise(xs), quantize_rowwise(ws)
        return (qx.float() * sx[:, None]) @ (qw.float() * sw[:, None]).t()

    s = smoothing_factors(x.abs().amax(0), [w], 0.5)
    fc = torch.nn.Linear(k, n, bias=False, device=device)
    fc.weight.copy_(w)
    found = search_scale(fc, [fc], x, AWQConfig())
    sa = found.scales
    rows = [
        {"case": f"W8A8, {outlier_frac:.0%} of channels x{magnitude:g}", "naive / RTN": err(w8a8(x, w)),
         "SmoothQuant / AWQ": err(w8a8(x / s, w * s))},
        {"case": "W4A16 g128, same activations", "naive / RTN": err(x @ fake_quantize_groupwise(w).t()),
         "SmoothQuant / AWQ": err((x / sa) @ fake_quantize_groupwise(w * sa).t()), "AWQ alpha": found.alpha},
    ]
    return rows


def run(cfg: DictConfig) -> dict:
    """Everything `main` does, callable without Hydra (tests); `performance_layers=false`: the
    paper path's torch references alone."""
    with performance_layers(cfg.get("performance_layers", True)):
        if not cfg.get("model"):
            raise ValueError("model=DIR is required: the float checkpoint to quantize")
        model_dir, device = Path(str(cfg.model)), resolve_device(cfg.device)
        methods = list(cfg.methods)
        unknown = sorted(set(methods) - set(METHODS))
        if unknown:
            raise ValueError(f"methods {unknown} are unknown; choose from {sorted(METHODS)}")
        out_dir = Path(hydra_run_dir())
        tokens = corpus_tokens("val", corpus=str(cfg.corpus))
        if cfg.max_tokens:
            tokens = tokens[: int(cfg.max_tokens) + 1]
        cal = cfg.calibration
        samples = calibration_samples(int(cal.n_samples), int(cal.seq_len), str(cal.corpus), int(cal.seed))

        fp32_eval = bool(cfg.get("fp32_eval", False))

        def ppl(m: torch.nn.Module) -> float:
            return perplexity(m, tokens, int(cfg.seq_len), int(cfg.batch_size))["ppl"]

        model = load_model(model_dir, device=device, dtype=torch.float32)
        outliers = outlier_table(input_stats(model, samples[: int(cfg.outlier_samples)]))
        base_fp32 = {"ppl fp32": ppl(model)} if fp32_eval else {}
        model = model.to(torch.bfloat16)
        base_ppl = ppl(model)
        weight_bytes = sum(p.numel() * 2 for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2)
        rows = [{"method": "bf16", "ppl": base_ppl, "vs bf16": 0.0, "decoder weight MB": weight_bytes / 1e6,
                 **base_fp32}]
        del model
        release_memory()
        awq = AWQConfig(**OmegaConf.to_container(cfg.awq, resolve=True))
        for method in methods:
            model = load_model(model_dir, device=device, dtype=torch.float32)
            t0 = time.perf_counter()
            quantize_model(model, method, samples, float(cfg.alpha), awq if method == "awq" else None,
                           progress=True)
            seconds = time.perf_counter() - t0
            path = save_quantized(model, out_dir / method, dtype=None)  # fp32: cast to bf16 at load, as bf16 was
            del model
            release_memory()
            qmodel = load_quantized_model(path, device, torch.bfloat16)
            qbytes = sum(b.numel() * b.element_size() for n, b in qmodel.named_buffers() if ".layers." in n)
            q_ppl = ppl(qmodel)
            rows.append({"method": method, "ppl": q_ppl, "vs bf16": q_ppl / base_ppl - 1,
                         "decoder weight MB": qbytes / 1e6, "quantize s": seconds})
            print(f"{method}: held-out perplexity {q_ppl:.4f} (bf16 {base_ppl:.4f})", flush=True)
            del qmodel
            release_memory()
            if fp32_eval and quantization_config_of(path).quant_method == "awq":  # weight-only: W4A16
                rows[-1]["ppl fp32"] = ppl(dequantize_model(load_quantized_model(path, device, torch.float32)))
                release_memory()
        by = {r["method"]: r["ppl"] for r in rows}
        summary = {}
        if {"awq", "rtn-w4"} <= set(by):
            gap = by["rtn-w4"] - by["bf16"]
            summary["awq_gap_closed"] = (by["rtn-w4"] - by["awq"]) / gap if gap > 0 else None
            if fp32_eval:
                f32 = {r["method"]: r["ppl fp32"] for r in rows if "ppl fp32" in r}
                gap = f32["rtn-w4"] - f32["bf16"]
                summary["awq_gap_closed_fp32"] = (f32["rtn-w4"] - f32["awq"]) / gap if gap > 0 else None
        if "smoothquant" in by:
            summary["smoothquant_vs_bf16"] = by["smoothquant"] / by["bf16"] - 1
            if "naive-w8a8" in by:
                summary["smoothquant_minus_naive_w8a8"] = by["smoothquant"] - by["naive-w8a8"]
        synthetic = synthetic_outliers(**cfg.synthetic, device=device)
        print_table(outliers, title=f"activation outliers of {model_dir} (SmoothQuant §3 statistic: max / "
                                    f"median over input channels of max|X_j|, {int(cfg.outlier_samples)} "
                                    "calibration windows)")
        print_table(synthetic, title="synthetic outlier channels: relative output error of one Linear")
        print_table(rows, title=f"held-out perplexity, {tokens.numel():,} tokens of {cfg.corpus}/val, seq_len "
                                f"{cfg.seq_len}, {device}")
        print("summary:", {k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()}, flush=True)
        record = {"model": str(model_dir), "rows": rows, "outliers": outliers, "synthetic": synthetic,
                  "summary": summary, "config": config_record(cfg)}
        write_json(out_dir / "quality.json", record)
        return record


@hydra.main(version_base=None, config_path="configs", config_name="quality")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
