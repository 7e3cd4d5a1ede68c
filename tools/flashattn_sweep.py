"""Config sweep for nano_flashattn's kernels (GPU only), then the bench with the swept tables.

    python tools/flashattn_sweep.py [--sweep-head-dims [64 96 128]] [--no-decode-sweep] [--no-bench]
                                    [bench options...]

head_dims the split_head layer runs (48, 80, 96, 144, 160, 192) are swept on its kernels into its tables
(printed under "nano_flashattn/layers/split_head.py"); with the bench option --no-split-head, on the padded
ones. On sm_90 the hopper.py layers' head_dims (forward 96 / 128, backward 64 / 96 / 128) are swept on them
into its DEFAULT_CONFIGS / BWD_CONFIGS (--no-hopper-forward / --no-hopper-backward: on the kernels beneath).
With the bench option --paper-path, every head_dim is swept on the paper path's kernels.

Tries a few tile shapes per kernel, keeps the fastest, writes it into nano_flashattn.configs' tables for the
rest of the process, prints the tables to paste into nano_flashattn/configs.py (with the one line that says
what they were tuned on), then runs `python -m nano_flashattn.bench` with the remaining options and saves
the sweep's scores in its bench.json. Every candidate is compiled first in parallel worker processes
(nano_flashattn.bench_compile), because compiling dozens of attention kernels one by one costs minutes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without an install

import nano_flashattn as fa
from nano_flashattn import bench, configs
from nano_flashattn.bench_compile import precompile, run_bwd, run_decode, run_fwd

FWD_CANDIDATES = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
                  (128, 64, 8, 4)]
# (BLOCK_M, BLOCK_N, num_warps, num_stages) of the dK/dV kernel, then of the dQ kernel
DKDV_CANDIDATES = [(32, 128, 4, 3), (64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 4, 2), (64, 128, 8, 3),
                   (32, 128, 8, 3), (64, 64, 4, 3)]
DQ_CANDIDATES = [(128, 32, 4, 3), (128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 2), (128, 64, 8, 3),
                 (128, 32, 8, 3), (64, 64, 4, 3)]
# (BLOCK_N, num_warps, num_stages) of the split kernel, contiguous and paged: a page lookup feeds the K/V
# addresses, and Triton's pipeliner only double-buffers such dependent loads from ~5 stages on
DECODE_CANDIDATES = {
    False: [(64, 4, 4), (64, 4, 3), (128, 4, 3), (128, 8, 3), (32, 4, 4), (64, 8, 4), (32, 4, 6)],
    True: [(64, 4, 4), (64, 4, 6), (64, 4, 8), (32, 4, 8), (128, 4, 5), (64, 8, 8), (32, 4, 6)],
}
DECODE_SPLITS = {(64, 4096): [1, 2, 4], (1, 65536): [16, 32, 64]}  # (batch, context): split counts
CUDA = torch.device("cuda")


def _ms(fn, graph: bool = False) -> float:
    if graph:  # decode: small kernels, replay a CUDA graph so that launch overhead does not count
        return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def _best(scores: dict, label: str):
    best = max(scores, key=scores.get)
    print(f"sweep {label}: best {best}  " + "  ".join(f"{k}:{v:.3f}" for k, v in scores.items()), flush=True)
    return best


def _tables(d: int):
    """The module whose config tables the kernels running head_dim d read: the split_head layer's when it is
    on and takes d, else configs (the paper path's)."""
    layer = bench.layer("split_head")
    return layer if layer is not None and layer.enabled() and d in layer.SPLIT_HEAD_DIMS else configs


def _hopper_forward(d: int):
    """The Hopper forward layer when it is on and takes head_dim d (its DEFAULT_CONFIGS are then d's table)."""
    layer = bench.layer("hopper")
    return layer if layer is not None and layer.enabled() and d in layer.ENABLED_HEAD_DIMS else None


def _bwd_tables(d: int):
    """The module whose backward table the kernels running head_dim d read: the Hopper backward layer's when
    it is on and takes d, else `_tables(d)`."""
    layer = bench.layer("hopper")
    return layer if layer is not None and layer.backward_enabled() and d in layer.BWD_CONFIGS else _tables(d)


def sweep_attention(head_dims, report: dict) -> None:
    """Forward, then the backward's dK/dV tiles with dQ's held, then dQ's with the best dK/dV: speed summed
    over causal and not (1/ms), at bench_compile's shape. Each head_dim is swept on the kernels that run it
    (the split_head layer's for its head_dims, the hopper.py forward's and backward's on sm_90, unless the
    bench options turn them off) and written into their tables."""
    base = {d: _bwd_tables(d).bwd_config(d, torch.bfloat16, CUDA) for d in head_dims}
    jobs = [("fwd", d, c, cfg) for d in head_dims for c in (False, True) for cfg in FWD_CANDIDATES]
    for d in head_dims:
        jobs += [("bwd", d, c, (a, base[d][1])) for c in (False, True) for a in DKDV_CANDIDATES]
        jobs += [("bwd", d, c, (base[d][0], b)) for c in (False, True) for b in DQ_CANDIDATES]
    failed = precompile(jobs)
    for d in head_dims:
        ok = [cfg for cfg in FWD_CANDIDATES
              if not any(str(("fwd", d, c, cfg)) in failed for c in (False, True))]
        scores = {cfg: sum(1 / _ms(run_fwd(d, c, cfg)) for c in (False, True)) for cfg in ok}
        best, hopper = _best(scores, f"fwd hd{d}"), _hopper_forward(d)
        if hopper is not None:  # its launcher reads a tuple as HopperConfig(block_m, block_n, warps, stages)
            hopper.DEFAULT_CONFIGS[d] = hopper.HopperConfig(*best[:2], num_warps=best[2], num_stages=best[3])
        else:
            _tables(d).FWD_CONFIGS[d] = best
        report["fwd"][d] = {str(k): v for k, v in scores.items()}
        best, scores = base[d], {}
        for which, candidates in ((0, DKDV_CANDIDATES), (1, DQ_CANDIDATES)):
            for cand in candidates:
                cfg = (cand, best[1]) if which == 0 else (best[0], cand)
                compiled = (cand, base[d][1]) if which == 0 else (base[d][0], cand)
                if not any(str(("bwd", d, c, compiled)) in failed for c in (False, True)):
                    scores[cfg] = sum(1 / _ms(run_bwd(d, c, cfg)) for c in (False, True))
            best = max(scores, key=scores.get)
        _bwd_tables(d).BWD_CONFIGS[d] = _best(scores, f"bwd hd{d}")
        report["bwd"][d] = {str(k): v for k, v in scores.items()}
        torch.cuda.empty_cache()


def sweep_decode(report: dict) -> None:
    """Split-kernel tiles per cache kind and padded head width (head_dims 64 and 128): fastest sum over the
    two shapes, each at its best split count."""
    for head_dim in (64, 128):
        _sweep_decode(report, head_dim)


def _sweep_decode(report: dict, head_dim: int) -> None:
    jobs = [("dec", head_dim, cfg, s, 16 * paged)
            for paged in (False, True) for cfg in DECODE_CANDIDATES[paged] for s in (1, 2)]
    failed = precompile(jobs)
    for paged in (False, True):
        ms = {}
        for cfg in DECODE_CANDIDATES[paged]:
            if any(str(("dec", head_dim, cfg, s, 16 * paged)) in failed for s in (1, 2)):
                continue
            for (b, ctx), splits in DECODE_SPLITS.items():
                for s in splits:
                    fn = run_decode(b, ctx, cfg, s, paged, head_dim=head_dim)
                    ms[(cfg, b, ctx, s)] = _ms(fn, graph=True)
        tried = {cfg for cfg, *_ in ms}
        speed = {cfg: 1 / sum(min(ms[(cfg, b, c, s)] for s in ss) for (b, c), ss in DECODE_SPLITS.items())
                 for cfg in tried}
        key = (paged, configs.decode_width(head_dim))
        configs.DECODE_CONFIGS[key] = _best(speed, f"decode paged={paged} hd{head_dim}")
        report["decode"][str(key)] = {str(k): v for k, v in ms.items()}
        torch.cuda.empty_cache()


def tables(command: str) -> str:
    """The swept tables as Python to paste into nano_flashattn/configs.py, with their one-line provenance."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    gpu, date = torch.cuda.get_device_name(), time.strftime("%Y-%m-%d")
    tuned = f"# Tuned on an {gpu}, {date}, commit {commit}: `{command}`"
    lines = [tuned, f"FWD_CONFIGS = {dict(sorted(configs.FWD_CONFIGS.items()))!r}",
             tuned, f"BWD_CONFIGS = {dict(sorted(configs.BWD_CONFIGS.items()))!r}",
             tuned, f"DECODE_CONFIGS = {configs.DECODE_CONFIGS!r}"]
    layer = bench.layer("split_head")
    if layer is not None and (layer.FWD_CONFIGS or layer.BWD_CONFIGS):
        lines += ["# nano_flashattn/layers/split_head.py:",
                  tuned, f"FWD_CONFIGS = {dict(sorted(layer.FWD_CONFIGS.items()))!r}",
                  tuned, f"BWD_CONFIGS = {dict(sorted(layer.BWD_CONFIGS.items()))!r}"]
    hopper = bench.layer("hopper")
    if hopper is not None and (hopper.backward_enabled() or hopper.enabled()):
        lines += ["# nano_flashattn/layers/hopper.py:", tuned,
                  f"DEFAULT_CONFIGS = {dict(sorted(hopper.DEFAULT_CONFIGS.items()))!r}", tuned,
                  f"BWD_CONFIGS = {dict(sorted(hopper.BWD_CONFIGS.items()))!r}"]
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sweep-head-dims", type=int, nargs="*", default=[64, 96, 128],
                   help="the head_dims whose forward and backward tables to sweep (none: decode only)")
    p.add_argument("--no-decode-sweep", action="store_true", help="keep the decode tables as they are")
    p.add_argument("--no-bench", action="store_true", help="only sweep and print the tables")
    args, bench_argv = p.parse_known_args(argv)
    if not torch.cuda.is_available():
        p.error("the sweep times kernels on a CUDA GPU")
    # the layers the bench will run are on while sweeping, so that each head_dim is tuned on its kernels
    bench_args = bench.parse_args(bench_argv)
    bench.set_layers(bench_args, CUDA)
    report = {"fwd": {}, "bwd": {}, "decode": {}}
    with fa.performance_layers(not bench_args.paper_path):
        sweep_attention(args.sweep_head_dims, report)
        if not args.no_decode_sweep:
            sweep_decode(report)
    command = "python tools/flashattn_sweep.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(tables(command), flush=True)
    if not args.no_bench:
        bench.main(bench_argv, sweep=report)
    return report


if __name__ == "__main__":
    main()
