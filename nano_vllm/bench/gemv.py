"""`python -m nano_vllm.bench gemv=true` — the decode GEMV on one model's layer shapes: the split-K Triton
GEMV (nano_vllm.layers.gemv) against cuBLAS (F.linear) and against `torch.compile` with max-autotune and gpt-fast's
inductor settings, in TB/s of bytes read (weights, x, y) beside the measured copy bandwidth.

For each shape (the decoder layer's fused qkv, o, fused gate_up and down projections, and the LM head) and
each row count M of `gemv_rows`: cuBLAS, our GEMV with its default launch config, and — with `gemv_sweep`
— the best config of a small grid (each checked against cuBLAS first); `torch.compile` at `gemv_compile_rows`.
The grid is searched in two rounds: every tile of SWEEP_M1 / SWEEP_DOT (SPLIT_K by `split_k_for` for the
shape), then the winner's pipeline stages and SPLIT_K (REFINE). At M = 1 the bench prints the winners as
`gemv.MEASURED_M1`, ready to paste, and records them under `measured_m1`.
The "layer" rows add up the four projections of one decoder layer. The bench prints the crossover: the
largest M up to which our GEMV beats cuBLAS on every shape (what `engine.gemv_max_tokens` should be).

    python -m nano_vllm.bench gemv=true                              # llama3-8b shapes, bf16, on CUDA
    python -m nano_vllm.bench gemv=true gemv_model=qwen3-0.6b gemv_compile=null
    python -m nano_vllm.bench gemv=true 'gemv_rows=[1]' gemv_compile=null   # the M = 1 sweep only (~2 min)
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any

import torch
import torch.nn.functional as F

from nano_vllm.layers.gemv import GemvConfig, GemvWorkspace, default_config, gemv_triton, num_sms, split_k_for
from shared.accounting import Ceilings
from shared.bench import benchmark, print_table
from shared.config import ModelConfig, resolve_model_config

# M = 1 tiles (block_n, block_k, num_warps) with 8..64 weights per thread per iteration: at least one 16-byte
# load each, at most 64 fp32 accumulator registers. Round one tries each without and with a 3-stage pipeline.
SWEEP_M1 = [GemvConfig(n, k, 1, w, s)
            for n, k, w, s in itertools.product((1, 2, 4, 8, 16, 32), (256, 512, 1024, 2048, 4096), (4, 8), (1, 3))
            if 8 * 32 * w <= n * k <= 64 * 32 * w]
SWEEP_DOT = [GemvConfig(n, k, s) for n, k, s in itertools.product((16, 32, 64), (128, 256), (1, 2, 4, 8))]
REFINE = list(itertools.product((1, 2, 4), (1, 2, 3, 4)))  # round two: (split_k, num_stages) of the winner


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(N, K) of every weight a decode step multiplies by, as the fused-projection layer holds them."""
    h = cfg.hidden_size
    return {"qkv_proj": (cfg.q_size + 2 * cfg.kv_size, h), "o_proj": (h, cfg.q_size),
            "gate_up_proj": (2 * cfg.intermediate_size, h), "down_proj": (h, cfg.intermediate_size),
            "lm_head": (cfg.vocab_size, h)}


def _compiled_linear(mode: str) -> Any:
    """F.linear under torch.compile with gpt-fast's inductor settings."""
    import torch._inductor.config as inductor

    inductor.coordinate_descent_tuning = True
    inductor.triton.unique_kernel_names = True
    return torch.compile(lambda x, w: F.linear(x, w), mode=mode, dynamic=False)


def _sweep_configs(m: int, n: int, k: int, sms: int, winner: GemvConfig | None) -> list[GemvConfig]:
    """Round one (no winner yet): every tile of the grid, with at least the SPLIT_K `split_k_for` gives the
    shape. Round two: the winner with each (split_k, num_stages) of REFINE whose slices hold a tile of K."""
    if winner is None:
        return [dataclasses.replace(c, split_k=max(c.split_k, split_k_for(n, k, c.block_n, c.block_k, sms)))
                for c in (SWEEP_M1 if m == 1 else SWEEP_DOT)]
    return [dataclasses.replace(winner, split_k=s, num_stages=st) for s, st in REFINE if k >= s * winner.block_k]


def _best_of_sweep(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor, device: torch.device,
                   tol: float, reps: dict) -> tuple[float, GemvConfig | None]:
    """Seconds and config of the fastest config of the two rounds whose output agrees with cuBLAS's."""
    best: tuple[float, GemvConfig | None] = (float("inf"), None)
    (m, k), n, tried = x.shape, w.shape[0], set()
    for round_ in range(2):
        if round_ == 1 and best[1] is None:
            break
        for c in _sweep_configs(m, n, k, num_sms(device), best[1] if round_ else None):
            if c in tried:
                continue
            tried.add(c)
            ws = GemvWorkspace(c.split_k * m * n, -(-n // c.block_n), device)
            out = torch.empty_like(ref)
            gemv_triton(x, w, config=c, workspace=ws, out=out)
            if not torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol):
                print(f"  config {c} disagrees with cuBLAS on {tuple(w.shape)}: skipped", flush=True)
                continue
            t = benchmark(gemv_triton, x, w, config=c, workspace=ws, out=out, device=device, **reps)
            best = min(best, (t, c), key=lambda p: p[0])
    return best


def _print_measured(rows: list[dict], device: torch.device, sms: int) -> dict[str, dict]:
    """The M = 1 winners as `gemv.MEASURED_M1`, ready to paste; returned for the JSON record."""
    winners = [r for r in rows if r["M"] == 1 and "_best" in r]
    if not winners:
        return {}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    print(f"\nMEASURED_M1_SMS = {sms}\nMEASURED_M1: dict[tuple[int, int], GemvConfig] = {{  # best of the "
          f"M = 1 sweep, {name}, {time.strftime('%Y-%m-%d')}")
    for r in winners:
        c = r["_best"]
        cmp = ", ".join(f"{s} {r[f'{s} TB/s']:.2f}" for s in ("cuBLAS", "torch.compile") if f"{s} TB/s" in r)
        print(f"    ({r['N']}, {r['K']}): GemvConfig({c.block_n}, {c.block_k}, {c.split_k}, {c.num_warps}, "
              f"{c.num_stages}),  # {r['shape']}: {r['best TB/s']:.2f} TB/s ({cmp})")
    print("}", flush=True)
    return {f"{r['N']}x{r['K']}": dataclasses.asdict(r["_best"]) for r in winners}


def run_gemv(cfg: Any, ceilings: Ceilings, device: str, interpreter: bool) -> dict:
    """The micro-bench (see the module docstring); returns its JSON record."""
    mcfg = resolve_model_config(str(cfg.gemv_model))
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    shapes = layer_shapes(mcfg)
    reps: dict[str, int] = {}
    if dev.type != "cuda":  # the interpreter: a small model's shapes, capped, to exercise the code path
        shapes = {k: (min(n, 128), min(kk, 128)) for k, (n, kk) in shapes.items()}
        reps = {"warmup": 1, "repeats": 2}
    copy = ceilings.copy_bytes_per_s
    compiled = _compiled_linear(str(cfg.gemv_compile)) if cfg.gemv_compile and dev.type == "cuda" else None
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    rows, sms = [], num_sms(dev)
    for m in [int(v) for v in cfg.gemv_rows]:
        totals: dict[str, float] = {}
        for name, (n, k) in shapes.items():
            g = torch.Generator(device=dev).manual_seed(n * 7 + k)
            x = torch.randn(m, k, device=dev, dtype=dtype, generator=g)
            w = torch.randn(n, k, device=dev, dtype=dtype, generator=g) / k**0.5
            nbytes = (n * k + m * k + m * n) * dtype.itemsize
            row: dict[str, Any] = {"shape": name, "M": m, "N": n, "K": k}
            times = {"cuBLAS": benchmark(F.linear, x, w, device=dev, **reps)}
            ref = F.linear(x, w)
            config = default_config(1 if m == 1 else 16, n, k, sms)
            if dev.type == "cuda" or interpreter:
                ws = GemvWorkspace.for_shapes([(n, k)], m, dev)
                out = torch.empty_like(ref)
                times["ours"] = benchmark(gemv_triton, x, w, config=config, workspace=ws, out=out, device=dev,
                                          **reps)
                row["config"] = str(config)
                if cfg.gemv_sweep:
                    t0 = time.perf_counter()
                    t, best = _best_of_sweep(x, w, ref, dev, tol, reps)
                    print(f"  swept {name} at M = {m} in {time.perf_counter() - t0:.0f} s: best {best}", flush=True)
                    if best is not None:
                        times["best"] = t
                        row["best config"], row["_best"] = str(best), best
            if compiled is not None and m in [int(v) for v in cfg.gemv_compile_rows]:
                compiled(x, w)  # compile (and autotune) outside the timing
                times["torch.compile"] = benchmark(compiled, x, w, device=dev)
            for system, t in times.items():
                row[f"{system} TB/s"] = nbytes / t / 1e12
                if name != "lm_head":
                    totals[system] = totals.get(system, 0.0) + t
            row["ours vs cuBLAS"] = times["cuBLAS"] / times["ours"] if "ours" in times else None
            row["ours % of copy"] = 100 * nbytes / times["ours"] / copy if "ours" in times else None
            if "best" in times:
                row["best vs cuBLAS"] = times["cuBLAS"] / times["best"]
                row["best % of copy"] = 100 * nbytes / times["best"] / copy
            rows.append(row)
        layer_bytes = sum((n * k + m * k + m * n) * dtype.itemsize for s, (n, k) in shapes.items() if s != "lm_head")
        layer = {"shape": "layer", "M": m, **{f"{s} TB/s": layer_bytes / t / 1e12 for s, t in totals.items()
                                               if all(f"{s} TB/s" in r for r in rows[-len(shapes):])}}
        if "ours" in totals:
            layer["ours vs cuBLAS"] = totals["cuBLAS"] / totals["ours"]
            layer["ours % of copy"] = 100 * layer_bytes / totals["ours"] / copy
        if "best" in totals and "best TB/s" in layer:
            layer["best vs cuBLAS"] = totals["cuBLAS"] / totals["best"]
            layer["best % of copy"] = 100 * layer_bytes / totals["best"] / copy
        rows.append(layer)
    wins = [r["M"] for r in rows if r["shape"] != "layer" and (r.get("ours vs cuBLAS") or 0) < 1]
    ms = sorted({r["M"] for r in rows})
    crossover = max([m for m in ms if m < min(wins, default=max(ms) + 1)], default=0)
    print_table(rows, title=f"GEMV on {cfg.gemv_model} shapes, "
                            f"{str(dtype).removeprefix('torch.')}; copy bandwidth {copy / 1e12:.2f} TB/s "
                            f"(read + write, measured)")
    print(f"crossover: our GEMV beats cuBLAS on every shape up to M = {crossover} "
          f"(engine.gemv_max_tokens={crossover})", flush=True)
    measured = _print_measured(rows, dev, sms)
    for r in rows:
        r.pop("_best", None)
    return {"bench": "nano_vllm.layers.gemv", "model": str(cfg.gemv_model), "device": device,
            "dtype": str(dtype).removeprefix("torch."), "ceilings": ceilings.as_dict(), "rows": rows,
            "crossover_rows": crossover, "measured_m1": measured}
