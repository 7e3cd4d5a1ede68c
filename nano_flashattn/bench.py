"""python -m nano_flashattn.bench: our kernels against torch SDPA (cuDNN and flash backends), one process.

    attention: flash-attn's benchmark grid (batch x seqlen = 16k tokens, heads x head_dim = 2048), bf16,
               forward and backward TFLOP/s, causal and not (FLOPs: 4 B S^2 H D, halved when causal,
               x2.5 for the backward: flash-attn's convention), head_dim 64, 96 and 128
    decode:    Flash-Decoding, one new token per sequence, 32 query / 8 kv heads: TB/s of K and V read,
               contiguous caches and paged caches (page 16, 256); SDPA reads a contiguous cache with the
               GQA group folded into its query axis (so it, too, reads K/V once)
    peers:     SDPA's cuDNN backend (the strongest on Hopper: the headline ratio) and its flash backend
               (FA2-class); every row prints ours / each
    targets:   each head_dim's row against head_dim 128's at the same shape (TFLOP/s or TB/s, so per unit
               of work), in the summary
    ceilings:  measured bf16 matmul TFLOP/s and device-copy TB/s, the physical limits of both
    layers:    every performance layer that is present and applies runs (--paper-path: none); each
               flag turns one off: split_head runs head_dims 48/80/96/144/160/192 (--no-split-head:
               padded tiles); on sm_90 the hopper.py backward (TMA loads) runs head_dims 64/96/128
               (--no-hopper-backward) and its forward head_dims 64/96/128 (--no-hopper-forward), both
               reading dense batches of whole tiles up to 8k keys through host-made descriptors
               (--no-host-descriptors: every program makes its own); the hopper_ws.py forward (Gluon,
               warp-specialised) runs dense head_dim 128 batches ahead of it (--no-gluon-forward), its
               backward dense head_dim 64/128 batches ahead of hopper.py's (--no-gluon-backward)
    --quick:   tiny shapes, runs on a CPU in seconds (the reference path); the default without a GPU,
               which says so (--no-quick: the full grid on a CPU, minutes); a CPU run also says when
               torch's threads outnumber the free cores (bench_host.oversubscription_warning)

The config sweep that tunes the kernels' tables is `python tools/flashattn_sweep.py [these options]` (from a
repository checkout: it sweeps, then runs this bench with the swept tables).
Prints a table with ratios; writes <out>/bench.json and <out>/bench.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F

import nano_flashattn as fa
from nano_flashattn.bench_host import oversubscription_warning
from nano_flashattn.launch import is_sm90

PEERS = [("sdpa_cudnn", "cudnn"), ("sdpa_flash", "flash")]  # the headline peer first
CAUSAL = {"both": (False, True), "yes": (True,), "no": (False,)}
QUICK = {"seqlens": [64, 128], "head_dims": [64], "tokens": 256, "hidden": 128, "decode_head_dims": [64],
         "decode_batches": [2], "decode_contexts": [256], "pages": [16]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m nano_flashattn.bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action=argparse.BooleanOptionalAction, default=None,
                   help="tiny shapes (default without a GPU, where the full grid takes minutes; a shape "
                        "option given still wins); --no-quick: the full grid anyway")
    p.add_argument("--out", default="bench_out/nano_flashattn", help="directory for bench.json and bench.md")
    p.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 96, 128])
    p.add_argument("--causal", choices=sorted(CAUSAL), default="both", help="attention rows: causal or not")
    p.add_argument("--tokens", type=int, default=16384, help="batch x seqlen of the attention grid")
    p.add_argument("--hidden", type=int, default=2048, help="heads x head_dim of the attention grid")
    p.add_argument("--decode-head-dims", type=int, nargs="+", default=[64, 96, 128])
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--decode-contexts", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--pages", type=int, nargs="+", default=[16, 256], help="paged-cache page sizes")
    p.add_argument("--max-decode-tokens", type=int, default=1 << 20, help="skip batch x context above this")
    p.add_argument("--no-attention", action="store_true")
    p.add_argument("--no-decode", action="store_true")
    p.add_argument("--no-split-head", action="store_true",
                   help="run every head_dim on the paper path's padded tiles (the split_head layer off)")
    p.add_argument("--no-hopper-backward", action="store_true",
                   help="run the backward on the paper path's pointer loads (the hopper.py TMA layer off)")
    p.add_argument("--no-hopper-forward", action="store_true",
                   help="run the forward on the paper path / split_head (the hopper.py TMA forward off)")
    p.add_argument("--no-gluon-forward", action="store_true",
                   help="leave dense head_dim 128 forwards to hopper.py (the hopper_ws.py Gluon layer off)")
    p.add_argument("--no-gluon-backward", action="store_true",
                   help="leave dense head_dim 64/128 backwards to hopper.py (the hopper_ws.py Gluon backward off)")
    p.add_argument("--no-host-descriptors", action="store_true",
                   help="the hopper.py layers make their TMA descriptors in every program, at every length")
    p.add_argument("--paper-path", action="store_true",
                   help="the paper path alone: every performance layer off (performance_layers=False)")
    p.add_argument("--sweep", action="store_true", help="moved: python tools/flashattn_sweep.py [options]")
    args = p.parse_args(argv)
    if args.sweep:  # the sweep is a tool, not part of the package (a non-editable install has no tools/)
        p.error("--sweep moved to the repository's tools/: run `python tools/flashattn_sweep.py [bench "
                "options]`, which sweeps the config tables and then runs this bench with them")
    if args.quick is None:
        args.quick = not torch.cuda.is_available()
    if args.quick:  # QUICK replaces the defaults; a shape given on the command line still wins
        for key, value in QUICK.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    return args


def time_ms(device: torch.device, fn, *args, graph: bool = False, **kwargs) -> float:
    """Median milliseconds of fn(*args, **kwargs): CUDA events (triton.testing) on a GPU, else
    perf_counter."""
    if device.type == "cuda":
        import triton.testing

        torch.cuda.synchronize()  # inputs made on the default stream; do_bench_cudagraph uses a side stream
        if graph:  # many small launches (decode): replay a CUDA graph so launch gaps do not count
            return triton.testing.do_bench_cudagraph(
                lambda: fn(*args, **kwargs), rep=100, return_mode="median"
            )
        return triton.testing.do_bench(lambda: fn(*args, **kwargs), warmup=25, rep=100, return_mode="median")
    fn(*args, **kwargs)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn(*args, **kwargs)
        times.append(time.perf_counter() - t)
    return 1e3 * sorted(times)[1]


def ceilings(device: torch.device) -> dict:
    """The two physical limits, measured: bf16 matmul TFLOP/s and device-copy TB/s (read + write)."""
    n = 8192 if device.type == "cuda" else 256
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    mm = time_ms(device, torch.matmul, a, b)
    x = torch.randn(2**28 if device.type == "cuda" else 2**20, device=device)  # 1 GiB on a GPU
    y = torch.empty_like(x)
    cp = time_ms(device, y.copy_, x)
    return {"matmul_tflops": 2 * n**3 / mm / 1e9, "copy_tbps": 2 * x.numel() * x.element_size() / cp / 1e9}


def sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[name])


def _peers(device):
    """(name, backend) of the SDPA peers: cuDNN and flash on a GPU, the default (math) on a CPU."""
    return PEERS if device.type == "cuda" else [("sdpa", None)]


def _try(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:  # a backend that refuses the shape: recorded, not fatal
        return f"unsupported: {str(e).splitlines()[0][:80]}"


def _ours_dense(q, k, v, causal):
    return fa.flash_attn_func(q, k, v, causal=causal)


def _sdpa_dense(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _fwd_tflops(f, inputs, causal, flops, device):
    return flops / time_ms(device, f, *inputs, causal) / 1e9


def _bwd_tflops(f, inputs, causal, grad, flops, device):
    inputs = [t.detach().requires_grad_() for t in inputs]
    out = f(*inputs, causal)
    ms = time_ms(device, torch.autograd.grad, out, inputs, grad, retain_graph=True)
    return 2.5 * flops / ms / 1e9


def bench_attention(args, device, dtype) -> list[dict]:
    rows = []
    for head_dim in args.head_dims:
        for causal in CAUSAL[args.causal]:
            for seqlen in args.seqlens:
                batch, heads = max(1, args.tokens // seqlen), args.hidden // head_dim
                shape = (batch, seqlen, heads, head_dim)
                q, k, v, do = (torch.randn(shape, device=device, dtype=dtype) for _ in range(4))
                flops = 4 * batch * seqlen**2 * heads * head_dim / (2 if causal else 1)
                row = {"head_dim": head_dim, "causal": causal, "seqlen": seqlen, "batch": batch,
                       "heads": heads}
                sdpa_layout = [t.transpose(1, 2).contiguous() for t in (q, k, v, do)]  # SDPA's (B, H, S, D)
                impls = [("ours", None, _ours_dense, (q, k, v), do)]
                impls += [(n, b, _sdpa_dense, sdpa_layout[:3], sdpa_layout[3]) for n, b in _peers(device)]
                for name, backend, f, inputs, grad in impls:
                    with sdpa_backend(backend) if backend else nullcontext():
                        row[f"{name}_fwd"] = _try(_fwd_tflops, f, inputs, causal, flops, device)
                        row[f"{name}_bwd"] = _try(_bwd_tflops, f, inputs, causal, grad, flops, device)
                rows.append(row)
                print(_fmt_attn(row), flush=True)
    return rows


def _paged_copy(cache: torch.Tensor, page: int, perm: torch.Tensor):
    """The contiguous (B, L, Hk, D) cache as pages scattered by `perm`: same values, same bytes."""
    b, length = cache.shape[:2]
    pages = torch.empty(b * (length // page), page, *cache.shape[2:], device=cache.device, dtype=cache.dtype)
    pages[perm] = cache.reshape(-1, page, *cache.shape[2:])
    return pages


def bench_decode(args, device, dtype, heads_q=32, heads_k=8) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for head_dim in args.decode_head_dims:
        for batch in args.decode_batches:
            for ctx in args.decode_contexts:
                if batch * ctx > args.max_decode_tokens:
                    continue
                rows.append(_decode_row(args, device, dtype, gen, head_dim, batch, ctx, heads_q, heads_k))
                print(_fmt_decode(rows[-1]), flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def _decode_row(args, device, dtype, gen, head_dim, batch, ctx, heads_q, heads_k) -> dict:
    q = torch.randn(batch, 1, heads_q, head_dim, device=device, dtype=dtype)
    kc = torch.randn(batch, ctx, heads_k, head_dim, device=device, dtype=dtype)
    vc = torch.randn_like(kc)
    seqlens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    kv_bytes = 2 * kc.numel() * kc.element_size()
    row = {"head_dim": head_dim, "batch": batch, "context": ctx, "kv_bytes": kv_bytes}
    g = device.type == "cuda"
    ms = time_ms(device, fa.flash_attn_with_kvcache, q, kc, vc, seqlens, graph=g)
    row["ours_contiguous"] = kv_bytes / ms / 1e9
    for page in args.pages:
        perm = torch.randperm(batch * ctx // page, generator=gen).to(device)
        kp, vp = _paged_copy(kc, page, perm), _paged_copy(vc, page, perm)
        table = perm.view(batch, -1).to(torch.int32)
        out = fa.flash_attn_with_kvcache(q, kp, vp, seqlens, block_table=table)
        torch.testing.assert_close(out, fa.flash_attn_with_kvcache(q, kc, vc, seqlens), atol=2e-2, rtol=0)
        ms = time_ms(device, fa.flash_attn_with_kvcache, q, kp, vp, seqlens, block_table=table, graph=g)
        row[f"ours_paged{page}"] = kv_bytes / ms / 1e9
        del kp, vp
    # SDPA: fold the GQA group into the query axis: (B, Hk, group, D) against (B, Hk, L, D)
    qs = q.view(batch, heads_k, heads_q // heads_k, head_dim)
    ks, vs = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
    for name, backend in _peers(device):
        with sdpa_backend(backend) if backend else nullcontext():
            ms = _try(time_ms, device, F.scaled_dot_product_attention, qs, ks, vs, graph=g)
            row[name] = kv_bytes / ms / 1e9 if isinstance(ms, float) else ms
    return row


def _num(x, nd=1):
    """`nd` decimals, or two significant digits below 1 (a CPU's 0.012 TFLOP/s must not print as 0.0)."""
    if not isinstance(x, float):
        return "n/a"
    return f"{x:.{nd}f}" if abs(x) >= 1 or x == 0 else f"{x:.2g}"


def _ratio(a, b):
    return f"{a / b:.2f}x" if isinstance(a, float) and isinstance(b, float) and b > 0 else "n/a"


def _fmt_attn(r):
    peers = [k[:-4] for k in r if k.endswith("_fwd") and k != "ours_fwd"]
    parts = [f"hd{r['head_dim']:<4}{'causal' if r['causal'] else 'full':<7}{r['seqlen']:>6}"]
    for d in ("fwd", "bwd"):
        parts.append(f"{d} ours {_num(r[f'ours_{d}'])}")
        parts += [f"{p} {_num(r[f'{p}_{d}'])} ({_ratio(r[f'ours_{d}'], r[f'{p}_{d}'])})" for p in peers]
    return " | ".join(parts)


def _fmt_decode(r):
    ours = [f"{k[5:]} {_num(v, 2)}" for k, v in r.items() if k.startswith("ours_")]
    best = max((v for k, v in r.items() if k.startswith("ours_") and isinstance(v, float)), default=None)
    peers = [f"{k} {_num(v, 2)} (best ours {_ratio(best, v)})" for k, v in r.items() if k.startswith("sdpa")]
    shape = f"decode hd{r['head_dim']:<4}b{r['batch']:<3} ctx{r['context']:>6}"
    return f"{shape} TB/s: " + ", ".join(ours + peers)


def summary(result: dict) -> list[str]:
    """Each head_dim against head_dim 128 at the same shape, and ours / each peer (markdown lines)."""
    lines = []
    attn = {(r["head_dim"], r["causal"], r["seqlen"]): r for r in result["attention"]}
    dec = {(r["head_dim"], r["batch"], r["context"]): r for r in result["decode"]}
    peers = [p for p in ("sdpa_cudnn", "sdpa_flash", "sdpa")
             if any(f"{p}_fwd" in r for r in attn.values()) or any(p in r for r in dec.values())]
    ratio_cols = "".join(f" ours / {p} |" for p in peers)
    head = "| hd | causal | seqlen | pass | ours | vs hd128 |" + ratio_cols
    rows = []
    for (d, causal, seqlen), r in attn.items():
        base = attn.get((128, causal, seqlen))
        for ps in ("fwd", "bwd"):
            ours = r[f"ours_{ps}"]
            vs128 = _ratio(ours, base[f"ours_{ps}"]) if base and d != 128 else "-"
            ratios = " | ".join(_ratio(ours, r.get(f"{p}_{ps}")) for p in peers)
            rows.append(f"| {d} | {causal} | {seqlen} | {ps} | {_num(ours, 0)} | {vs128} | {ratios} |")
    if rows:
        lines += ["Attention, TFLOP/s:", "", head, "|" + "---|" * (6 + len(peers)), *rows, ""]
    rows = []
    for (d, batch, ctx), r in dec.items():
        base = dec.get((128, batch, ctx))
        for k, v in r.items():
            if not k.startswith("ours_"):
                continue
            vs128 = _ratio(v, base.get(k)) if base and d != 128 else "-"
            ratios = " | ".join(_ratio(v, r.get(p)) for p in peers)
            rows.append(f"| {d} | {batch} | {ctx} | {k[5:]} | {_num(v, 2)} | {vs128} | {ratios} |")
    if rows:
        head = "| hd | batch | context | cache | ours TB/s | vs hd128 |" + ratio_cols
        lines += ["Decode:", "", head, "|" + "---|" * (6 + len(peers)), *rows, ""]
    return lines


def markdown(result: dict) -> str:
    env, ceil = result["env"], result["ceilings"]
    lines = [
        f"{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}: "
        f"matmul {ceil['matmul_tflops']:.4g} TFLOP/s, copy {ceil['copy_tbps']:.4g} TB/s, "
        f"split_head {'on' if env.get('split_head') else 'off'}",
        "",
    ]
    if result["attention"]:
        peers = [k[:-4] for k in result["attention"][0] if k.endswith("_fwd") and k != "ours_fwd"]
        cols = [f"{d} {n}" for d in ("fwd", "bwd") for n in ["ours", *peers]]
        lines += ["| hd | causal | seqlen | " + " | ".join(cols) + " |", "|" + "---|" * (3 + len(cols))]
        for r in result["attention"]:
            cells = [_num(r[f"{n}_{d}"], 0) for d in ("fwd", "bwd") for n in ["ours", *peers]]
            lines.append(f"| {r['head_dim']} | {r['causal']} | {r['seqlen']} | " + " | ".join(cells) + " |")
        lines.append("")
    if result["decode"]:
        keys = [k for k in result["decode"][0] if k.startswith(("ours_", "sdpa"))]
        lines += [
            "| hd | batch | context | " + " | ".join(f"{k} TB/s" for k in keys) + " |",
            "|" + "---|" * (3 + len(keys)),
        ]
        for r in result["decode"]:
            cells = " | ".join(_num(r.get(k), 2) for k in keys)
            lines.append(f"| {r['head_dim']} | {r['batch']} | {r['context']} | {cells} |")
        lines.append("")
    return "\n".join(lines + summary(result))


# The ablation flags: each turns one layer's registrations off for the run. {env key: (flag, layer module,
# its enable / disable functions)}.
LAYER_FLAGS = {
    "split_head": ("no_split_head", "split_head", "enable", "disable"),
    "hopper_backward": ("no_hopper_backward", "hopper", "enable_backward", "disable_backward"),
    "hopper_forward": ("no_hopper_forward", "hopper", "enable", "disable"),
    "gluon_forward": ("no_gluon_forward", "hopper_ws", "enable", "disable"),
    "gluon_backward": ("no_gluon_backward", "hopper_ws", "enable_backward", "disable_backward"),
}


def layer(name: str):
    """The performance layer module `name` (nano_flashattn/layers/), or None where it is missing."""
    return sys.modules[fa.REGISTRY.module_name(name)] if fa.REGISTRY.present(name) else None


def set_layers(args, device: torch.device) -> dict:
    """Turn each layer's registrations on, or off where its --no-* flag says so, and the host descriptors
    of the Hopper layers; returns, per flag, whether that layer runs here: present, on, not --paper-path,
    and on a device it applies to (CUDA; sm_90 for the Hopper layers, with Gluon for hopper_ws)."""
    fa.load_layers()
    runs = {}
    for key, (flag, name, enable, disable) in LAYER_FLAGS.items():
        mod, off = layer(name), getattr(args, flag)
        if mod is not None:
            getattr(mod, disable if off else enable)()
        here = device.type == "cuda" and (name == "split_head" or is_sm90(device))
        here = here and (name != "hopper_ws" or getattr(mod, "HAS_GLUON", False))
        runs[key] = mod is not None and not off and not args.paper_path and here
    hopper, runs["host_descriptors_up_to"] = layer("hopper"), 0
    if hopper is not None:  # the longest sequence read through host-made descriptors (0: none)
        hopper.HOST_DESCRIPTORS_UP_TO = 0 if args.no_host_descriptors else hopper.HOST_DESCRIPTORS_DEFAULT
        if runs["hopper_forward"] or runs["hopper_backward"]:
            runs["host_descriptors_up_to"] = hopper.HOST_DESCRIPTORS_UP_TO
    return runs


def main(argv=None, sweep: dict | None = None) -> dict:
    """Run the bench; `sweep` (a config sweep's report, from tools/flashattn_sweep.py) is saved with it."""
    args = parse_args(argv)
    with fa.performance_layers(not args.paper_path):  # --paper-path: every lookup finds no layer
        return run(args, argv, sweep)


def run(args: argparse.Namespace, argv, sweep: dict | None) -> dict:
    """The bench with parsed `args`, in the performance-layer context `main` set."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    import triton

    env = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "command": "python -m nano_flashattn.bench " + " ".join(sys.argv[1:] if argv is None else argv),
        "ours": "triton" if device.type == "cuda" else "torch reference (no GPU)",
        "performance_layers": not args.paper_path,
        "missing_layers": sorted(fa.load_layers()),
        **set_layers(args, device),
    }
    result = {"env": env, "ceilings": ceilings(device), "sweep": sweep, "attention": [], "decode": []}
    print(f"{env['device']} | torch {env['torch']} | triton {env['triton']} | ours = {env['ours']} | "
          f"performance layers {'on' if env['performance_layers'] else 'off (--paper-path)'}"
          f"{', missing ' + ', '.join(env['missing_layers']) if env['missing_layers'] else ''} | "
          f"split_head {'on' if env['split_head'] else 'off'} | "
          f"hopper backward {'on' if env['hopper_backward'] else 'off'} | "
          f"hopper forward {'on' if env['hopper_forward'] else 'off'} | "
          f"gluon forward {'on' if env['gluon_forward'] else 'off'} | "
          f"gluon backward {'on' if env['gluon_backward'] else 'off'} | "
          f"host descriptors up to {env['host_descriptors_up_to']} keys"
          f"{' (hd64 forward: any length)' if env['host_descriptors_up_to'] else ''}")
    ceil = result["ceilings"]  # 4 significant digits: a CPU's matmul is 0.04 TFLOP/s, not "0"
    print(f"ceilings: matmul {ceil['matmul_tflops']:.4g} TFLOP/s, copy {ceil['copy_tbps']:.4g} TB/s")
    if args.quick:
        print("note: quick run (no GPU, or --quick): tiny shapes (seqlen 64/128, head_dim 64, decode context "
              "256) instead of flash-attn's benchmark grid (16k tokens, head_dim 64/96/128, decode contexts up "
              "to 64k); numbers from this run say nothing about GPU throughput (--no-quick: the full grid)",
              flush=True)
    warning = oversubscription_warning(device)
    if warning:
        print(warning, flush=True)
    os.makedirs(args.out, exist_ok=True)

    def save():  # after every section, so that a run cut short still leaves its numbers
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
        with open(os.path.join(args.out, "bench.md"), "w") as f:
            f.write(markdown(result))

    if device.type == "cuda":
        from .bench_compile import precompile_tables

        precompile_tables([] if args.no_attention else args.head_dims,
                          [] if args.no_decode else args.decode_head_dims, args.pages, CAUSAL[args.causal])
    if not args.no_attention:
        result["attention"] = bench_attention(args, device, dtype)
        save()
    if not args.no_decode:
        result["decode"] = bench_decode(args, device, dtype)
        save()
    print("\n" + markdown(result))
    return result


if __name__ == "__main__":
    main()
