"""`python -m shared.bench` (also `python -m shared.bench_kernels`): each shared kernel, through the
dispatcher, against the eager torch code it replaces, `torch.nn.functional`'s fused op where one exists and
(on CUDA by default) that eager code under `torch.compile`; then one training step of shared.model against
`transformers`' implementation of the same architecture. Timed with shared.bench's helpers.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from shared.bench import (
    benchmark,
    datasheet_bf16_flops,
    format_rate,
    mbu,
    measure_copy_bandwidth,
    measure_matmul_flops,
    mfu,
    print_table,
    report_oversubscription,
    write_json,
)

# Eager baselines: what the model would run without shared.kernels (Hugging Face Llama's code).


def _eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _eager_rope(x: torch.Tensor, cos_full: torch.Tensor, sin_full: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos_full + torch.cat((-x2, x1), dim=-1) * sin_full


def _rows_for(
    op: str, impls: dict[str, Callable[[], Any]], nbytes: int, copy_bw: float, **timing
) -> list[dict]:
    rows, eager = [], None
    for impl, fn in impls.items():
        try:
            seconds = benchmark(fn, **timing)
        except Exception as e:  # a peer that does not compile here costs its row, not the bench
            if impl != COMPILED:
                raise
            _no_compiled_row(op, e)
            continue
        eager = eager or seconds  # the first entry is the eager baseline
        rows.append({
            "op": op, "impl": impl, "ms": seconds * 1e3, "GB/s": nbytes / seconds / 1e9,
            "% copy bw": 100 * mbu(nbytes / seconds, copy_bw), "vs eager": eager / seconds,
        })  # fmt: skip
    return rows


COMPILED = "torch.compile"  # the peer's row: the eager reference fused by inductor, no hand-written kernel


def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    return torch.compile(fn, dynamic=False)


def _no_compiled_row(op: str, e: Exception) -> None:
    print(f"{op}: no {COMPILED} row ({type(e).__name__}: {str(e)[:200]})", flush=True)


LIGER = "liger-kernel"  # the peer's row: LinkedIn's Triton kernels (RMSNorm, fused add + RMSNorm, RoPE, SwiGLU)


def _liger(dev: torch.device) -> Any:
    """liger_kernel.ops on CUDA when installed (`pip install liger-kernel`), else None: its rows are left out."""
    if dev.type != "cuda":
        return None
    try:
        import liger_kernel.ops.fused_add_rms_norm
        import liger_kernel.ops.rms_norm
        import liger_kernel.ops.rope
        import liger_kernel.ops.swiglu
    except ImportError:
        return None
    return liger_kernel.ops


def _add_norm(x, r, w, eps, norm):
    """(norm(x + r), x + r): the two tensors a fused add + RMSNorm returns, the sum the next residual."""
    s = x + r
    return norm(s, w, eps), s


def _bench_rms_norm(t, h, dtype, dev, ours, copy_bw, timing, compiled=False) -> list[dict]:
    from shared.kernels import rms_norm

    e, eps = torch.finfo(dtype).bits // 8, 1e-6
    x, r, dy = (torch.randn(t, h, device=dev, dtype=dtype) for _ in range(3))
    w = 1 + 0.1 * torch.randn(h, device=dev, dtype=dtype)
    peer = hasattr(F, "rms_norm")  # torch >= 2.4; fused on CUDA in recent releases
    norm_c = _compiled(_eager_rms_norm) if compiled else None
    add_norm_c = _compiled(lambda x, r, w: _add_norm(x, r, w, eps, _eager_rms_norm)) if compiled else None

    impls = {"torch eager": lambda: _eager_rms_norm(x, w, eps), ours: lambda: rms_norm(x, w, eps)}
    if peer:
        impls["F.rms_norm"] = lambda: F.rms_norm(x, (h,), w, eps)
    if compiled:
        impls[COMPILED] = lambda: norm_c(x, w, eps)
    liger = _liger(dev)
    if liger is not None:  # Llama's casting (fp32 normalisation, cast, then × weight), as ours; not in place
        impls[LIGER] = lambda: liger.rms_norm.LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)
    rows = _rows_for("rms_norm fwd", impls, 2 * t * h * e + h * e, copy_bw, **timing)

    # every peer returns what ours does: the normalised output and the new residual x + r
    impls = {
        "torch eager": lambda: _add_norm(x, r, w, eps, _eager_rms_norm),
        ours: lambda: rms_norm(x, w, eps, residual=r),
    }
    if peer:
        impls["F.rms_norm"] = lambda: _add_norm(x, r, w, eps, lambda s, w, eps: F.rms_norm(s, (h,), w, eps))
    if compiled:
        impls[COMPILED] = lambda: add_norm_c(x, r, w)
    if liger is not None:  # returns (norm(x + r), x + r), as ours
        impls[LIGER] = lambda: liger.fused_add_rms_norm.LigerFusedAddRMSNormFunction.apply(x, r, w, eps)
    rows += _rows_for("add+rms_norm fwd", impls, 4 * t * h * e + h * e, copy_bw, **timing)

    xg, wg = x.requires_grad_(), w.requires_grad_()
    y_eager, y_ours = _eager_rms_norm(xg, wg, eps), rms_norm(xg, wg, eps)
    impls = {
        "torch eager": lambda: torch.autograd.grad(y_eager, (xg, wg), dy, retain_graph=True),
        ours: lambda: torch.autograd.grad(y_ours, (xg, wg), dy, retain_graph=True),
    }
    if compiled:  # the backward inductor generated for the compiled forward
        try:
            y_c = norm_c(xg, wg, eps)
        except Exception as err:  # (`e` is the element size here)
            _no_compiled_row("rms_norm bwd", err)
        else:
            impls[COMPILED] = lambda: torch.autograd.grad(y_c, (xg, wg), dy, retain_graph=True)
    if liger is not None:
        y_l = liger.rms_norm.LigerRMSNormFunction.apply(xg, wg, eps, 0.0, "llama", False)
        impls[LIGER] = lambda: torch.autograd.grad(y_l, (xg, wg), dy, retain_graph=True)
    return rows + _rows_for("rms_norm bwd", impls, 3 * t * h * e + 2 * h * e, copy_bw, **timing)


def _bench_rope(t, h, dtype, dev, ours, copy_bw, timing, compiled=False) -> list[dict]:
    from shared.kernels import apply_rope

    d = 128 if h % 128 == 0 else 2 * (h // 2)  # Llama's head_dim; the heads fill the hidden size
    q = torch.randn(t, h // d, d, device=dev, dtype=dtype)
    theta = torch.randn(t, d // 2, device=dev)
    cos, sin = theta.cos(), theta.sin()
    cos_full, sin_full = (torch.cat([c, c], -1).to(dtype)[:, None] for c in (cos, sin))  # HF's layout
    impls = {"torch eager": lambda: _eager_rope(q, cos_full, sin_full), ours: lambda: apply_rope(q, cos, sin)}
    if compiled:
        rope_c = _compiled(_eager_rope)
        impls[COMPILED] = lambda: rope_c(q, cos_full, sin_full)
    nbytes = 2 * q.numel() * q.element_size() + 2 * cos.numel() * 4
    rows = _rows_for(f"rope (head_dim {d})", impls, nbytes, copy_bw, **timing)
    liger = _liger(dev)
    if liger is None:
        return rows
    # liger rotates q and k in one call, (batch, heads, seq, d): the same op on q and a k of a quarter of
    # the heads (GQA 4:1), against ours called on each
    k = torch.randn(t, max(1, h // d // 4), d, device=dev, dtype=dtype)
    ql, kl = (z.transpose(0, 1)[None] for z in (q.clone(), k.clone()))
    impls = {"torch eager": lambda: (_eager_rope(q, cos_full, sin_full), _eager_rope(k, cos_full, sin_full)),
             ours: lambda: (apply_rope(q, cos, sin), apply_rope(k, cos, sin)),
             LIGER: lambda: liger.rope.LigerRopeFunction.apply(ql, kl, cos[None], sin[None], None, 1, d)}
    nbytes = 2 * (q.numel() + k.numel()) * q.element_size() + 2 * cos.numel() * 4
    return rows + _rows_for(f"rope q and k (head_dim {d})", impls, nbytes, copy_bw, **timing)


def _bench_silu_and_mul(t, h, dtype, dev, ours, copy_bw, timing, compiled=False) -> list[dict]:
    from shared.kernels import silu_and_mul

    inter = 256 * math.ceil(int(8 * h / 3) / 256)  # Llama's FFN width rule: 4096 -> 11008
    g, u = (torch.randn(t, inter, device=dev, dtype=dtype) for _ in range(2))
    impls = {"torch eager": lambda: F.silu(g) * u, ours: lambda: silu_and_mul(g, u)}
    if compiled:
        silu_c = _compiled(lambda g, u: F.silu(g) * u)
        impls[COMPILED] = lambda: silu_c(g, u)
    liger = _liger(dev)
    if liger is not None:
        impls[LIGER] = lambda: liger.swiglu.LigerSiLUMulFunction.apply(g, u)
    return _rows_for(
        f"silu_and_mul ({inter} wide)", impls, 3 * g.numel() * g.element_size(), copy_bw, **timing
    )


def run_kernel_bench(device: str, tokens: int, hidden: int, dtype: torch.dtype, quick: bool = False,
                     compiled: bool = False) -> dict:
    """Time each shared kernel (through the dispatcher) against eager torch on the same inputs, and with
    `compiled` against the eager reference under `torch.compile` (the peer a user gets for free).

    GB/s counts each op's minimal traffic (every input read once, every output written once), the
    same for every implementation, so the column compares speed, not bytes moved."""
    from shared.kernels import use_triton

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    timing = {"device": dev, "warmup": 1 if quick else 5, "repeats": 3 if quick else 20}
    copy_bw = measure_copy_bandwidth(dev, nbytes=None if cuda and not quick else 64 << 20)
    mm_n = (8192 if cuda else 512) // (4 if quick else 1)
    mm_dtype = torch.bfloat16 if cuda else torch.float32
    matmul = measure_matmul_flops(dev, n=mm_n, dtype=mm_dtype)
    ours = "triton" if use_triton(torch.empty(0, device=dev)) else "torch ref (dispatch)"
    rows = []
    for bench in (_bench_rms_norm, _bench_rope, _bench_silu_and_mul):
        rows += bench(tokens, hidden, dtype, dev, ours, copy_bw, timing, compiled)
    return {
        "bench": "shared.kernels", "device": str(dev), "dtype": str(dtype).removeprefix("torch."),
        "tokens": tokens, "hidden": hidden, "ours": ours, "copy_GBps": copy_bw / 1e9,
        "matmul_TFLOPs": matmul / 1e12, "matmul": f"{mm_n}^3 {str(mm_dtype).removeprefix('torch.')}",
        "rows": rows,
    }  # fmt: skip


def run_model_bench(preset: str, device: str, batch: int, seq_len: int, dtype: torch.dtype,
                    peak_flops: float, quick: bool = False, datasheet_flops: float | None = None) -> dict:
    """One training step (forward + backward) of shared.model against `transformers`' implementation of
    the same architecture (SDPA attention, the peer users already run), same shapes, same dtype.

    tokens/s and MFU = flops_per_token (6N + 12·L·d·S, shared.accounting) × tokens/s over the measured
    matmul peak `peak_flops`, and over `datasheet_flops` when given (`datasheet_bf16_flops`)."""
    from shared.accounting import flops_per_token
    from shared.config import resolve_model_config
    from shared.model import build_model

    cfg = resolve_model_config(preset)
    dev = torch.device(device)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len), device=dev)
    timing = {"device": dev, "warmup": 1 if quick else 3, "repeats": 2 if quick else 10, "flush_l2": False}

    def step(model: torch.nn.Module, logits_of: Callable) -> Callable[[], None]:
        def run() -> None:
            logits = logits_of(model(ids))
            loss = F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
            loss.backward()
            model.zero_grad(set_to_none=True)
        return run

    impls: dict[str, Callable[[], None]] = {}
    ours = build_model(cfg, device=dev, dtype=dtype)
    impls["shared.model"] = step(ours, lambda out: out)
    try:
        import transformers

        hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa")
        impls[f"transformers {transformers.__version__}"] = step(hf.to(dev, dtype), lambda out: out.logits)
    except ImportError:
        pass
    flops = flops_per_token(cfg, seq_len) * batch * seq_len
    half = flops_per_token(cfg, seq_len, causal_halved=True) * batch * seq_len
    rows, ref = [], None
    for name, fn in impls.items():
        seconds = benchmark(fn, **timing)
        ref = ref or seconds
        row = {"model": preset, "impl": name, "ms/step": seconds * 1e3, "tokens/s": batch * seq_len / seconds,
               "MFU % (measured matmul)": 100 * mfu(flops / seconds, peak_flops)}
        if datasheet_flops:
            row["MFU % (datasheet)"] = 100 * mfu(flops / seconds, datasheet_flops)
            # the attention FLOPs a causal kernel does: half of PaLM's count
            row["MFU % (datasheet, causal attention halved)"] = 100 * mfu(half / seconds, datasheet_flops)
        rows.append({**row, "ours x faster": seconds / ref})
    del ours, impls
    return {"bench": "shared.model train step", "model": preset, "batch": batch, "seq_len": seq_len,
            "dtype": str(dtype).removeprefix("torch."), "peak_TFLOPs_measured": peak_flops / 1e12,
            "peak_TFLOPs_datasheet": datasheet_flops / 1e12 if datasheet_flops else None, "rows": rows}


def build_parser() -> argparse.ArgumentParser:
    """The command line of `python -m shared.bench`."""
    p = argparse.ArgumentParser(prog="python -m shared.bench", description="the shared kernels and the model's "
                                "training step against their peers, with the device's physical limits")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=None, help="rows (default: 32768 on CUDA, 256 on CPU)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument(
        "--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="default: bf16 CUDA, fp32 CPU"
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--quick", action="store_true", help="few tokens and repeats: a smoke test")
    p.add_argument("--model", default=None,
                   help="preset for the model train-step bench (default: qwen3-0.6b on CUDA, tiny on CPU; "
                        "'none' skips it)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help=f"add each kernel's eager reference under torch.compile as a peer row ('{COMPILED}'); "
                        "default: on CUDA only (inductor on a CPU needs a C++ compiler and minutes)")
    p.add_argument("--batch", type=int, default=None, help="model bench batch (default: 4 CUDA, 2 CPU)")
    p.add_argument("--seq-len", type=int, default=None, help="model bench seq_len (default: 2048 CUDA, 128 CPU)")
    return p


def main(argv: list[str] | None = None) -> dict:
    a = build_parser().parse_args(argv)
    cuda = torch.device(a.device).type == "cuda"
    tokens = a.tokens or ((4096 if cuda else 32) if a.quick else (32768 if cuda else 256))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        a.dtype or ("bf16" if cuda else "fp32")
    ]
    if not cuda:
        print(
            "note: Triton kernels need CUDA; on this device the dispatcher runs the torch references,\n"
            "      so 'torch ref (dispatch)' below is the plain-torch reference against eager torch,\n"
            "      not a kernel.",
            flush=True,
        )
    report_oversubscription(a.device)
    compiled = cuda if a.compile is None else a.compile
    rec = run_kernel_bench(a.device, tokens, a.hidden, dtype, quick=a.quick, compiled=compiled)
    print(
        f"physical limits on {a.device}: copy {format_rate(rec['copy_GBps'] * 1e9, 'B/s')} (read + write), "
        f"matmul {format_rate(rec['matmul_TFLOPs'] * 1e12, 'FLOP/s')} ({rec['matmul']})"
    )
    model = a.model or ("qwen3-0.6b" if cuda else "tiny")
    if model != "none":
        batch, seq_len = a.batch or (4 if cuda else 2), a.seq_len or ((512 if a.quick else 2048) if cuda else 128)
        rec["model"] = run_model_bench(model, a.device, batch, seq_len, dtype, rec["matmul_TFLOPs"] * 1e12,
                                       quick=a.quick, datasheet_flops=datasheet_bf16_flops(a.device))
    if a.json:
        write_json(a.json, rec)
        print(f"wrote {a.json}")
    print_table(
        rec["rows"], title=f"shared.kernels: {tokens} tokens x {a.hidden} hidden, {rec['dtype']}, {a.device}"
    )
    if "model" in rec:
        m = rec["model"]
        print_table(m["rows"], title=f"shared.model train step (fwd+bwd): batch {m['batch']} x "
                                     f"{m['seq_len']} tokens, {m['dtype']}, {a.device}; MFU against the "
                                     f"measured matmul peak ({format_rate(m['peak_TFLOPs_measured'] * 1e12, 'FLOP/s')})"
                                     + (f" and the datasheet's dense bf16 ({m['peak_TFLOPs_datasheet']:.0f} TFLOP/s)"
                                        if m["peak_TFLOPs_datasheet"] else ""))
    return rec


if __name__ == "__main__":
    main()
