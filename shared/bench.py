"""The project's one timing helper, and `python -m shared.bench`: the shared kernels against eager torch
and against that eager code under `torch.compile`, and the model's training step against `transformers`.

Every bench in the repo times with `benchmark`, states its physical limits with
`measure_copy_bandwidth` / `measure_matmul_flops` (reported through `mbu` / `mfu`; MFU also against the
datasheet peak, `datasheet_bf16_flops`), prints with `print_table` and records with `write_json`, so numbers
from different packages are comparable.

    python -m shared.bench                  # GPU: 32768 tokens x 4096 hidden, bf16; CPU: a small smoke run
    python -m shared.bench --quick --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import socket
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import torch
import torch.nn.functional as F


def _device_of(device: str | torch.device | None, args: tuple, kwargs: dict) -> torch.device:
    if device is not None:
        return torch.device(device)
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cpu")


def benchmark(
    fn: Callable[..., Any],
    *args: Any,
    warmup: int = 5,
    repeats: int = 20,
    device: str | torch.device | None = None,
    flush_l2: bool = True,
    **kwargs: Any,
) -> float:
    """Median seconds of `fn(*args, **kwargs)` over `repeats` calls, after `warmup` untimed calls.

    The device is `device`, else that of the first tensor argument, else the CPU. On CUDA each call
    is bracketed by CUDA events after a short GPU spin that hides the host's launch work (GPU time;
    host overhead is not counted: time it end to end if it matters), and with `flush_l2` a buffer of
    twice the L2 size is overwritten before each call so inputs come from HBM, as in a real model
    whose other layers evict them. Elsewhere each call is timed with `time.perf_counter` (after a
    CUDA synchronize when CUDA is in use, so pass `device=` for GPU work to get event timing).
    """
    if repeats < 1:
        raise ValueError(f"benchmark: repeats must be >= 1, got {repeats}")
    dev = _device_of(device, args, kwargs)
    if dev.type != "cuda":
        # A CUDA callable timed without naming its device (a lambda has no tensor argument) is still
        # timed to completion, not to the end of its asynchronous launches.
        sync = torch.cuda.synchronize if torch.cuda.is_initialized() else (lambda: None)
        for _ in range(warmup):
            fn(*args, **kwargs)
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            fn(*args, **kwargs)
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    with torch.cuda.device(dev):
        for _ in range(warmup):
            fn(*args, **kwargs)
        flush = None
        if flush_l2:
            l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 64 << 20) or 64 << 20
            flush = torch.empty(2 * l2, dtype=torch.int8, device=dev)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        torch.cuda.synchronize(dev)
        for start, end in zip(starts, ends):
            if flush is not None:
                flush.zero_()
            # Keep the GPU busy (~0.5 ms spin) while the host enqueues fn, so the events time the
            # kernels, not Python/launch overhead the GPU would otherwise sit idle through.
            torch.cuda._sleep(1_000_000)
            start.record()
            fn(*args, **kwargs)
            end.record()
        torch.cuda.synchronize(dev)
    return statistics.median(s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends))


def release_memory() -> None:
    """Collect garbage and return cached CUDA blocks: call after dropping one system (an engine, a model)
    and before building the next, which sizes its buffers (a KV cache) from the free memory it sees."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class KernelCompiles:
    """Context manager: the Triton kernel variants first built in this process while it is active.

    Triton compiles (or loads from its disk cache) one variant per new specialisation — argument dtypes,
    divisibility by 16, constexprs — the first time a kernel meets it. A bench wraps its timed region in
    this to show whether compilation leaked into it (`names`: one kernel name per variant; `reprs`: the
    full signature, to see which argument made it new). Uses `triton.knobs.runtime.jit_cache_hook`; off
    where Triton has no such hook (`available` False)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.reprs: list[str] = []
        self.available = False

    def __enter__(self) -> KernelCompiles:
        try:
            from triton import knobs
            self._runtime = knobs.runtime
            self._previous = knobs.runtime.jit_cache_hook
        except (ImportError, AttributeError):
            return self
        self.available = True
        self._runtime.jit_cache_hook = self._hook
        return self

    def _hook(self, *args: Any, **kwargs: Any) -> bool | None:
        fn = kwargs.get("fn")
        self.names.append(getattr(fn, "name", str(fn)))
        self.reprs.append(str(kwargs.get("repr", "")))
        previous = self._previous
        return previous(*args, **kwargs) if previous is not None else None  # None: compile as usual

    def __exit__(self, *exc: Any) -> None:
        if self.available:
            self._runtime.jit_cache_hook = self._previous

    def summary(self) -> str:
        if not self.available:
            return "kernel variants built: unknown (no Triton jit_cache_hook)"
        detail = ", ".join(f"{n} x{c}" for n, c in Counter(self.names).most_common())
        return f"Triton kernel variants first built here: {len(self.names)}" + (f" ({detail})" if detail else "")


# Dense bf16 tensor-core peak of the H100 / H200 SXM datasheets (no sparsity): what published MFUs are
# quoted against. `measure_matmul_flops` gives the rate this process actually reaches.
DATASHEET_BF16_TFLOPS = 989.0
_DATASHEET_GPUS = ("H100", "H200")


def datasheet_bf16_flops(device: str | torch.device) -> float | None:
    """The datasheet's dense bf16 FLOP/s of `device` (H100 / H200 SXM: 989e12), None for any other device."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    name = torch.cuda.get_device_name(dev)
    return DATASHEET_BF16_TFLOPS * 1e12 if any(g in name for g in _DATASHEET_GPUS) else None


def mfu(flops_per_second: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s as a fraction of a peak (e.g. measured matmul FLOP/s)."""
    if peak_flops <= 0:
        raise ValueError(f"mfu: peak_flops must be > 0, got {peak_flops}")
    return flops_per_second / peak_flops


def mbu(bytes_per_second: float, peak_bandwidth: float) -> float:
    """Memory bandwidth utilisation: achieved bytes/s as a fraction of a peak (e.g. measured copy)."""
    if peak_bandwidth <= 0:
        raise ValueError(f"mbu: peak_bandwidth must be > 0, got {peak_bandwidth}")
    return bytes_per_second / peak_bandwidth


def measure_copy_bandwidth(device: str | torch.device, nbytes: int | None = None) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written: the practical
    ceiling of any memory-bound kernel. Default size: 1 GiB on CUDA (far above L2), 64 MiB elsewhere."""
    dev = torch.device(device)
    nbytes = nbytes or (1 << 30 if dev.type == "cuda" else 64 << 20)
    src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    seconds = benchmark(dst.copy_, src, device=dev, flush_l2=False, warmup=3, repeats=10)
    return 2 * nbytes / seconds


def measure_matmul_flops(
    device: str | torch.device, n: int | None = None, dtype: torch.dtype | None = None
) -> float:
    """FLOP/s of an n x n x n matmul (2 n^3 FLOPs): the practical compute ceiling.
    Defaults: n=8192 in bf16 on CUDA, n=512 in fp32 elsewhere."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    n = n or (8192 if cuda else 512)
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    a, b = (torch.randn(n, n, device=dev, dtype=dtype) for _ in range(2))
    c = torch.empty(n, n, device=dev, dtype=dtype)
    seconds = benchmark(torch.mm, a, b, out=c, device=dev, flush_l2=False, warmup=3, repeats=10)
    return 2 * n**3 / seconds


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    return "" if v is None else str(v)


def format_table(rows: list[dict], title: str | None = None) -> str:
    """Rows of dicts as an aligned text table: columns in first-seen key order, numbers right-aligned; keys
    starting with "_" are for the JSON record only."""
    cols = list(dict.fromkeys(k for r in rows for k in r if not k.startswith("_")))
    cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    numeric = [all(isinstance(r.get(c), (int, float)) or r.get(c) is None for r in rows) for c in cols]

    def line(items: list[str]) -> str:
        return "  ".join(
            s.rjust(w) if num else s.ljust(w) for s, w, num in zip(items, widths, numeric)
        ).rstrip()

    out = [title] if title else []
    out += [line(cols), "  ".join("-" * w for w in widths)] + [line(row) for row in cells]
    return "\n".join(out)


def print_table(rows: list[dict], title: str | None = None) -> None:
    """Print `format_table(rows, title)`."""
    print(format_table(rows, title), flush=True)


def write_json(path: str | os.PathLike, record: dict) -> dict:
    """Write `record` as JSON, adding when and where it was measured (date, host, GPU, python,
    torch and triton versions, the command line); returns what was written."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    }
    full = {**meta, **record}
    parent = os.path.dirname(os.fspath(path))
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w") as f:
        json.dump(full, f, indent=2, default=str)
        f.write("\n")
    return full


# ------------------------------------------------------------------ python -m shared.bench: the kernels
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


def _bench_rms_norm(t, h, dtype, dev, ours, copy_bw, timing, compiled=False) -> list[dict]:
    from shared.kernels import rms_norm

    e, eps = torch.finfo(dtype).bits // 8, 1e-6
    x, r, dy = (torch.randn(t, h, device=dev, dtype=dtype) for _ in range(3))
    w = 1 + 0.1 * torch.randn(h, device=dev, dtype=dtype)
    peer = hasattr(F, "rms_norm")  # torch >= 2.4; fused on CUDA in recent releases
    norm_c = _compiled(_eager_rms_norm) if compiled else None
    add_norm_c = _compiled(lambda x, r, w: _eager_rms_norm(x + r, w, eps)) if compiled else None

    impls = {"torch eager": lambda: _eager_rms_norm(x, w, eps), ours: lambda: rms_norm(x, w, eps)}
    if peer:
        impls["F.rms_norm"] = lambda: F.rms_norm(x, (h,), w, eps)
    if compiled:
        impls[COMPILED] = lambda: norm_c(x, w, eps)
    rows = _rows_for("rms_norm fwd", impls, 2 * t * h * e + h * e, copy_bw, **timing)

    impls = {
        "torch eager": lambda: _eager_rms_norm(x + r, w, eps),
        ours: lambda: rms_norm(x, w, eps, residual=r),
    }
    if peer:
        impls["F.rms_norm"] = lambda: F.rms_norm(x + r, (h,), w, eps)
    if compiled:
        impls[COMPILED] = lambda: add_norm_c(x, r, w)
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
    return _rows_for(f"rope (head_dim {d})", impls, nbytes, copy_bw, **timing)


def _bench_silu_and_mul(t, h, dtype, dev, ours, copy_bw, timing, compiled=False) -> list[dict]:
    from shared.kernels import silu_and_mul

    inter = 256 * math.ceil(int(8 * h / 3) / 256)  # Llama's FFN width rule: 4096 -> 11008
    g, u = (torch.randn(t, inter, device=dev, dtype=dtype) for _ in range(2))
    impls = {"torch eager": lambda: F.silu(g) * u, ours: lambda: silu_and_mul(g, u)}
    if compiled:
        silu_c = _compiled(lambda g, u: F.silu(g) * u)
        impls[COMPILED] = lambda: silu_c(g, u)
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


# ------------------------------------------------------------------ python -m shared.bench: the model
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
    rows, ref = [], None
    for name, fn in impls.items():
        seconds = benchmark(fn, **timing)
        ref = ref or seconds
        row = {"model": preset, "impl": name, "ms/step": seconds * 1e3, "tokens/s": batch * seq_len / seconds,
               "MFU % (measured matmul)": 100 * mfu(flops / seconds, peak_flops)}
        if datasheet_flops:
            row["MFU % (datasheet)"] = 100 * mfu(flops / seconds, datasheet_flops)
        rows.append({**row, "ours x faster": seconds / ref})
    del ours, impls
    return {"bench": "shared.model train step", "model": preset, "batch": batch, "seq_len": seq_len,
            "dtype": str(dtype).removeprefix("torch."), "peak_TFLOPs_measured": peak_flops / 1e12,
            "peak_TFLOPs_datasheet": datasheet_flops / 1e12 if datasheet_flops else None, "rows": rows}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m shared.bench", description=__doc__.split("\n")[0])
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
    a = p.parse_args(argv)
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
    compiled = cuda if a.compile is None else a.compile
    rec = run_kernel_bench(a.device, tokens, a.hidden, dtype, quick=a.quick, compiled=compiled)
    print(
        f"physical limits on {a.device}: copy {rec['copy_GBps']:.0f} GB/s (read + write), "
        f"matmul {rec['matmul_TFLOPs']:.1f} TFLOP/s ({rec['matmul']})"
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
                                     f"{m['seq_len']} tokens, {m['dtype']}, {a.device}; MFU per GPU against the "
                                     f"measured matmul peak ({m['peak_TFLOPs_measured']:.4g} TFLOP/s)"
                                     + (f" and the datasheet's dense bf16 ({m['peak_TFLOPs_datasheet']:.0f} TFLOP/s)"
                                        if m["peak_TFLOPs_datasheet"] else ""))
    return rec


if __name__ == "__main__":
    main()
