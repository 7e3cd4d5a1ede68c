"""`python -m shared.report`: the benches' JSON (committed in docs/results/) drawn as figures in docs/img/.

Each JSON file is recognised by its content (the record a bench writes), not its name; a figure whose
input is missing is skipped, and the report says which bench to run for it:

  attention_hd<D>.png  nano_flashattn.bench: TFLOP/s vs sequence length, ours / SDPA flash / SDPA cuDNN
  decode.png           nano_flashattn.bench: Flash-Decoding TB/s of K/V read vs context, per batch
  vllm_roofline.png    nano_vllm.bench: output tokens/s of each system beside the workload's roofline
  vllm_timeline.png    nano_vllm.bench: host and device busy intervals of consecutive engine steps
  mfu_scaling.png      shared / nano_megatron / nano_zero benches: MFU (by denominator), scaling efficiency
  sglang_hit_rate.png  nano_sglang.bench: prefix-cache hit rate vs the analytic optimum, programs/s
  distserve_slo.png    nano_distserve.bench mode=measured: SLO attainment vs rate, measured and simulated
  kv_cache.png         nano_quant.bench_kv: quantized KV cache vs 16 bits (kernel, engine, tokens per GiB)
  specdec_speedup.png  nano_specdec.bench: speedup over plain decode and τ vs batch size, per workload

Into docs/img it keeps only the figures a page shows (`shown_figures`: an `img/NAME.png` in a Markdown file);
the others are removed and named, so the folder holds no figure that no page shows.

    python -m shared.report                            # docs/results/*.json -> docs/img/*.png
    python -m shared.report --results DIR --out DIR

matplotlib is an optional extra: `pip install -e ".[plot]"`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS_IMG = ROOT / "docs" / "img"  # the pages' figures: only those a page shows are kept there
PAGE_FIGURE = re.compile(r"img/([A-Za-z0-9_.-]+\.png)")
PLOT_HINT = 'shared.report draws with matplotlib, which is not installed: pip install -e ".[plot]"'
# How to produce each kind of input, said when it is missing (copy the bench's JSON into docs/results/).
SOURCES = {
    "flashattn": "python -m nano_flashattn.bench --out DIR (DIR/bench.json)",
    "vllm": "python -m nano_vllm.bench (bench.json in its Hydra run directory)",
    "training": "python -m shared.bench --json FILE, or the nano_megatron / nano_zero bench's bench.json",
    "sglang": "python -m nano_sglang.bench (bench.json in its Hydra run directory)",
    "distserve": "python -m nano_distserve.bench mode=measured (bench.json in its Hydra run directory)",
    "kv": "python -m nano_quant.bench_kv (bench_kv.json in its Hydra run directory)",
    "specdec": "python -m nano_specdec.bench (bench.json in its Hydra run directory)",
}
IMPL_LABELS = {"ours": "nano_flashattn", "sdpa_flash": "SDPA flash (FA2-class)", "sdpa_cudnn": "SDPA cuDNN",
               "sdpa": "SDPA (default backend)"}
# "MFU % (<peak> ...)": shared.accounting's MFU_MEASURED / MFU_DATASHEET ("measured peak", "datasheet peak")
# and the labels the training benches write ("measured matmul", "datasheet")
MFU_KEY = re.compile(r"MFU % \((measured|datasheet)\b[^)]*\)")
Record = tuple[str, dict]  # (file name, parsed JSON)


def kind_of(record: dict) -> str | None:
    """Which bench wrote `record` (a key of SOURCES), or None for JSON no figure reads."""
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("attention"), list) or isinstance(record.get("decode"), list):
        return "flashattn"
    bench = record.get("bench")
    if bench == "nano_vllm":
        return "vllm"
    if bench in ("shared.kernels", "nano_megatron", "nano_zero"):
        return "training"
    if bench == "nano_sglang":
        return "sglang"
    if bench == "nano_quant.bench_kv":
        return "kv"
    if bench == "nano_specdec":
        return "specdec"
    if record.get("mode") in ("measured", "sim") and isinstance(record.get("systems"), list):
        return "distserve"
    return None


def load_results(results: Path) -> tuple[dict[str, list[Record]], list[str]]:
    """The JSON files under `results`, grouped by kind_of; plus a note for each file no figure reads."""
    if not results.is_dir():
        raise FileNotFoundError(f"results directory {str(results)!r} does not exist (run from the repository "
                                "root, or pass --results)")
    groups: dict[str, list[Record]] = {k: [] for k in SOURCES}
    notes = []
    for path in sorted(results.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        kind = kind_of(record)
        transcribed = isinstance(record, dict) and "transcribed" in str(record.get("source", ""))
        if transcribed:  # the page's rule: a figure, like a number, comes from a JSON a bench wrote
            notes.append(f"ignored {path.name}: transcribed from a printed table, not written by a bench")
        elif kind is None:
            notes.append(f"ignored {path.name}: no figure reads this record")
        else:
            groups[kind].append((path.name, record))
    return groups, notes


def _num(v: Any) -> float | None:
    """A finite number, or None (benches record a refused shape as a string such as 'unsupported: ...')."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _where(record: dict) -> str:
    """'GPU, date' from a record (write_json's fields, or nano_flashattn's env), whatever is present."""
    env = record.get("env") or {}
    gpu = record.get("gpu") or env.get("device") or record.get("device")
    date = str(record.get("date") or env.get("date") or "")[:10]
    return ", ".join(str(x) for x in (gpu, date) if x)


def _card(record: dict) -> str:
    """'H100 2026-12-07': the card's model and the date of a record, for a bar label among other cards."""
    gpu = str(record.get("gpu") or (record.get("env") or {}).get("device") or "")
    card = next((c for c in ("H100", "H200", "A100") if c in gpu), gpu)
    return " ".join(x for x in (card, str(record.get("date") or "")[:10]) if x)


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def _title(fig, text: str, record: dict) -> None:
    where = _where(record)
    fig.suptitle(text + (f"\n{where}" if where else ""), fontsize=11)


def _grid(n: int, width: float, height: float, columns: int = 2) -> tuple[Any, list]:
    """A figure of n panels, `columns` to a row; the unused cells of the last row are hidden."""
    import matplotlib.pyplot as plt

    cols = min(n, columns)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def _png(out: Path, base: str, name: str, records: list[Record]) -> Path:
    """out/base.png, or out/base_<file stem>.png when several files draw the same figure."""
    return out / (f"{base}_{Path(name).stem}.png" if len(records) > 1 else f"{base}.png")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90, metadata={"Software": None})  # no version stamp: redraws diff cleanly
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _curves(ax, rows: list[dict], x: str, series: dict[str, str], ceiling: Any, ceiling_label: str,
            xlabel: str, ylabel: str) -> None:
    """One line per {label: key} of `series` over rows[x] (log2 axis; non-numbers skipped), a ceiling line."""
    for label, key in series.items():
        pts = [(r[x], _num(r.get(key))) for r in rows if _num(r.get(key)) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label)
    if _num(ceiling):
        ax.axhline(ceiling, ls=":", c="grey", label=ceiling_label)
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)


# ------------------------------------------------------------------ nano_flashattn
def fig_attention(records: list[Record], out: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    paths = []
    for name, rec in records:
        rows = rec.get("attention") or []
        if not rows:
            continue
        impls = [k[:-4] for k in rows[0] if k.endswith("_fwd")]
        ceiling = rec.get("ceilings", {}).get("matmul_tflops")
        for hd in sorted({r["head_dim"] for r in rows}):
            # a column per masking the run measured (a causal-only run gets no empty panels)
            causals = sorted({bool(r["causal"]) for r in rows if r["head_dim"] == hd})
            fig, axes = plt.subplots(2, len(causals), figsize=(5 * len(causals), 7), sharex=True, squeeze=False)
            for i, direction in enumerate(("fwd", "bwd")):
                for j, causal in enumerate(causals):
                    ax = axes[i][j]
                    sel = sorted((r for r in rows if r["head_dim"] == hd and bool(r["causal"]) == causal),
                                 key=lambda r: r["seqlen"])
                    series = {IMPL_LABELS.get(i, i): f"{i}_{direction}" for i in impls}
                    _curves(ax, sel, "seqlen", series, ceiling, "bf16 matmul, measured", "sequence length",
                            "TFLOP/s")
                    ax.set_title(f"{'backward' if direction == 'bwd' else 'forward'}, "
                                 f"{'causal' if causal else 'not causal'}", fontsize=10)
            axes[0][0].legend(fontsize=8)
            _title(fig, f"Attention TFLOP/s, head_dim {hd} (flash-attn's FLOP convention)", rec)
            paths.append(_save(fig, _png(out, f"attention_hd{hd}", name, records)))
    return paths


def _decode_label(impl: str) -> str:
    if impl.startswith("ours_paged"):
        return f"nano_flashattn, paged (page {impl.removeprefix('ours_paged')})"
    return {"ours_contiguous": "nano_flashattn, contiguous"}.get(impl) or IMPL_LABELS.get(impl, impl)


def fig_decode(records: list[Record], out: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    paths = []
    for name, rec in records:
        rows = rec.get("decode") or []
        if not rows:
            continue
        batches = sorted({r["batch"] for r in rows})
        impls = [k for k in rows[0] if k.startswith(("ours_", "sdpa"))]
        copy = rec.get("ceilings", {}).get("copy_tbps")
        head_dims = sorted({r.get("head_dim", 128) for r in rows})
        # one context at several head_dims: TB/s over head_dim instead (each point is one head_dim)
        x = "head_dim" if len(head_dims) > 1 and len({r["context"] for r in rows}) == 1 else "context"
        fig, axes = plt.subplots(1, len(batches), figsize=(max(7.5, 4.2 * len(batches)), 3.8), squeeze=False)
        for ax, b in zip(axes[0], batches):
            sel = sorted((r for r in rows if r["batch"] == b), key=lambda r: r[x])
            _curves(ax, sel, x, {_decode_label(i): i for i in impls}, copy, "device copy, measured",
                    "head_dim" if x == "head_dim" else "context (keys)", "TB/s of K/V read")
            ax.set_title(f"batch {b}" + (f" x {sel[0]['context']} keys" if x == "head_dim" else ""), fontsize=10)
        axes[0][0].legend(fontsize=7)
        dims = "head_dim " + " / ".join(map(str, head_dims))
        _title(fig, f"Flash-Decoding: one new token per sequence, 32 q / 8 kv heads, {dims}", rec)
        paths.append(_save(fig, _png(out, "decode", name, records)))
    return paths


# ------------------------------------------------------------------ nano_vllm
def fig_vllm(records: list[Record], out: Path) -> list[Path]:
    fig, axes = _grid(len(records), 5.8, 4.4)
    for ax, (_, rec) in zip(axes, records):
        rows = rec["rows"]
        names = [r["system"] for r in rows] + ["roofline"]
        values = [r["output tok/s"] for r in rows] + [rec["roofline_tok_per_s"]]
        bars = ax.bar(range(len(names)), values, color=["C0"] * len(rows) + ["lightgrey"],
                      hatch=[""] * len(rows) + ["//"])
        for bar, r in zip(bars, rows):
            pct = _num(r.get("% of roofline"))
            ax.annotate(_fmt(r["output tok/s"]) + (f"\n{pct:.1f}% of roofline" if pct else ""),
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=8)
        ax.set_xticks(range(len(names)), [textwrap.fill(n, 18) for n in names], fontsize=8)
        ax.set_ylabel("output tokens/s")
        w = rec.get("workload") or {}
        copy, read = _num(rec.get("copy_GBps")), _num(rec.get("roofline_GBps"))
        n = w.get("num_seqs", "?")
        bound = (f"; roofline at {read:,.0f} GB/s read-only stream" if read else
                 f"; roofline at {copy:,.0f} GB/s copy" if copy else "")
        requests = f"{n} request{'' if n == 1 else 's'}" + (", pdl off" if rec.get("pdl") is False else "")
        ax.set_title(f"{rec.get('model')}, {requests}{bound}\n{_where(rec)}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    _title(fig, "nano_vllm offline throughput against its roofline (bytes actually read)", {})
    return [_save(fig, out / "vllm_roofline.png")]


TIMELINE_COLORS = {"schedule": "C1", "prepare": "C2", "launch": "C0", "postprocess": "C3"}


def fig_vllm_timeline(records: list[Record], out: Path) -> list[Path]:
    """One panel per nano_vllm record with a `timeline` (StepTimer's): a host lane (each phase's busy
    intervals; white is waiting or other host work) over a device lane (each step's work; white is idle)."""
    from matplotlib.patches import Patch

    timed = [(name, rec) for name, rec in records if (rec.get("timeline") or {}).get("window")]
    if not timed:
        raise KeyError("timeline")
    fig, axes = _grid(len(timed), 11, 2.2, columns=1)
    for ax, (name, rec) in zip(axes, timed):
        window, summary = rec["timeline"]["window"], rec["timeline"].get("summary") or {}
        for phase, a, b in window["host"]:
            ax.broken_barh([(a, b - a)], (1.1, 0.8), color=TIMELINE_COLORS.get(phase, "grey"))
        ax.broken_barh([(a, b - a) for a, b in window["device"]], (0, 0.8), color="C4")
        ax.set_yticks([0.4, 1.5], ["device", "host"])
        ax.set_xlabel("ms")
        layers = rec.get("performance_layers") or {}
        on = ", ".join(k for k, v in layers.items() if v) or "paper path only"
        stats = ", ".join(f"{label} {_num(summary.get(key)):.2f}" for label, key in (
            ("host busy", "host_busy_ms_per_step"), ("device busy", "device_busy_ms_per_step"),
            ("device idle", "device_idle_ms_per_step")) if _num(summary.get(key)) is not None)
        ax.set_title(f"{Path(name).stem}: {rec.get('model')}, {len(window['device'])} steps; ms per step: {stats}"
                     f"\nlayers: {on}; {_where(rec)}", fontsize=8)
    handles = [Patch(color=c, label=p) for p, c in TIMELINE_COLORS.items()] + [Patch(color="C4", label="device")]
    axes[0].legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    _title(fig, "nano_vllm engine steps: where the host and the device spend the time", {})
    return [_save(fig, out / "vllm_timeline.png")]


def fig_vllm_kernels(records: list[Record], out: Path) -> list[Path]:
    """One panel per nano_vllm record with a `kernel_profile` (bench/kernel_profile.py, batch-1 runs): µs a
    decode step per kernel (what each adds to the step), the bubbles between kernels last; GB/s where the
    layer knows a launch's bytes."""
    profiled = [(name, rec) for name, rec in records if (rec.get("kernel_profile") or {}).get("available")]
    if not profiled:
        raise KeyError("kernel_profile")
    fig, axes = _grid(len(profiled), 11, 3.6, columns=1)
    for ax, (name, rec) in zip(axes, profiled):
        p = rec["kernel_profile"]
        rows = [r for r in p["kernels"] if r["us/step"] >= 1.0]
        labels = [f"{r['kernel']} x{r['launches/step']:g}" for r in rows] + ["bubbles"]
        values = [r["us/step"] for r in rows] + [p["bubbles us/step"]]
        bars = ax.barh(labels[::-1], values[::-1], color=["C7"] + ["C0"] * len(rows))
        for bar, r in zip(bars[::-1], rows):
            if _num(r.get("GB/s")) is not None:
                ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {r['GB/s']:.0f} GB/s",
                        va="center", fontsize=7)
        ax.set_xlabel("µs a decode step")
        ax.tick_params(axis="y", labelsize=7)
        layers = ", ".join(k for k, v in (rec.get("performance_layers") or {}).items() if v) or "paper path only"
        ax.set_title(f"{Path(name).stem}: {rec.get('model')}, {p['kernels/step']:.0f} kernels a step, device span "
                     f"{p['device span us/step']:.0f} µs\nlayers: {layers}; {_where(rec)}", fontsize=8)
    _title(fig, "nano_vllm batch-1 decode: where a step's device time goes (torch.profiler)", {})
    return [_save(fig, out / "vllm_kernels.png")]


# ------------------------------------------------------------------ training: MFU and scaling
def _mfu_bars(name: str, rec: dict) -> list[tuple[str, float, str]]:
    """(label, MFU %, denominator) bars of the training record in file `name`; the denominator names the
    peak ("measured 797 TFLOP/s", "datasheet 989 TFLOP/s"): bars against different peaks are kept apart."""
    bench, ceilings, out = rec["bench"], rec.get("ceilings") or {}, []
    if bench == "shared.kernels":
        model = rec.get("model") or {}
        rows, peak, default = model.get("rows", []), _num(rec.get("matmul_TFLOPs")), "measured"
        prefix = f"{Path(name).stem}: {model.get('model', 'model')} step,"
    else:
        rows, peak, prefix = rec.get("rows", []), _num(rec.get("peak_TFLOPs_for_MFU")), f"{Path(name).stem}:"
        measured = _num(rec.get("matmul_TFLOPs_measured"))
        default = "measured" if peak and measured and abs(peak - measured) < 1e-6 else "datasheet"
    # the peaks as `Ceilings.as_dict()` names them, else as the training benches record them
    peaks = {"measured": _num(ceilings.get("matmul_TFLOPs")) or _num(rec.get("matmul_TFLOPs_measured"))
             or _num(rec.get("matmul_TFLOPs")),
             "datasheet": _num(ceilings.get("datasheet_TFLOPs")) or _num(rec.get("peak_TFLOPs_datasheet"))}
    card = _card(rec)
    for r in rows:
        gpus = f"{r['GPUs']} GPU{'s' if r['GPUs'] != 1 else ''}" if "GPUs" in r else ""
        where = ", ".join(x for x in (gpus, card) if x)
        label = f"{prefix} {r.get('impl') or r.get('system')}" + (f" ({where})" if where else "")
        keyed = [(key, m.group(1)) for key in r if (m := MFU_KEY.fullmatch(key))]
        for key, kind in keyed:
            if _num(r.get(key)) is not None:
                what = f"{kind} {peaks[kind]:.0f} TFLOP/s" if peaks[kind] else kind
                halved = ", causal attention halved" if "halved" in key else ""  # its own bars
                out.append((label, r[key], what + halved))
        if not keyed and _num(r.get("MFU %")) is not None:
            out.append((label, r["MFU %"], f"{default} {peak:.0f} TFLOP/s" if peak else default))
    return out


def _scaling_bars(name: str, rec: dict) -> list[tuple[str, float]]:
    """(label, scaling efficiency %) bars of the multi-GPU record in file `name`."""
    out = []
    for r in rec.get("rows", []):
        pct = _num(r.get("scaling eff %")) or 100 * (_num(r.get("scaling efficiency")) or 0)
        if pct:
            out.append((f"{Path(name).stem}: {r['system']}", pct))
    return out


def fig_training(records: list[Record], out: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    mfu = [b for name, rec in records for b in _mfu_bars(name, rec)]
    scaling = [b for name, rec in records for b in _scaling_bars(name, rec)]
    if not mfu and not scaling:
        raise KeyError("MFU % / scaling efficiency")
    panels = [p for p in (("MFU %", mfu), ("scaling efficiency %", scaling)) if p[1]]
    height = 0.45 * max(len(mfu), len(scaling)) + 2
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels) + (4.5 if len(panels) == 1 else 0), height),
                             squeeze=False)
    for ax, (xlabel, bars) in zip(axes[0], panels):
        kinds = list(dict.fromkeys(b[2] for b in bars)) if xlabel == "MFU %" else []
        colors = [f"C{kinds.index(b[2])}" if kinds else "C2" for b in bars]
        ax.barh(range(len(bars)), [b[1] for b in bars], color=colors)
        ax.set_xlim(0, 2.0 * max(b[1] for b in bars) if kinds else 115)  # room for the legend / 100% line
        ax.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
        ax.invert_yaxis()
        for i, b in enumerate(bars):
            ax.annotate(f" {b[1]:.1f}", (b[1], i), va="center", fontsize=8)
        if kinds:
            from matplotlib.patches import Patch

            ax.legend([Patch(color=f"C{i}") for i in range(len(kinds))], [f"vs {k}" for k in kinds],
                      fontsize=8, loc="lower right")
        else:
            ax.axvline(100, ls=":", c="grey")
        ax.set_xlabel(xlabel)
        ax.grid(axis="x", alpha=0.3)
    _title(fig, "Training: MFU (6N + 12·L·d·S FLOPs per token), scaling; card and date in each label", {})
    return [_save(fig, out / "mfu_scaling.png")]


# ------------------------------------------------------------------ nano_sglang
def fig_sglang(records: list[Record], out: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    paths = []
    for name, rec in records:
        rows = rec["rows"]
        if not rows:  # a JSON-decoding-only run (workloads=[]): no hit rates to draw
            continue
        workloads = list(dict.fromkeys(r["workload"] for r in rows))
        systems = list(dict.fromkeys(r["system"] for r in rows))
        width = 0.8 / len(systems)
        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
        for k, system in enumerate(systems):
            by = {r["workload"]: r for r in rows if r["system"] == system}
            xs = [i + (k - (len(systems) - 1) / 2) * width for i in range(len(workloads))]
            left.bar(xs, [by[w]["hit rate"] if w in by else 0 for w in workloads], width, label=system)
            ratio = [_num(by[w].get("vs vllm off")) if w in by else None for w in workloads]
            right.bar(xs, [v or 0 for v in ratio], width, label=system)
        optimum = [next(r["optimal hit rate"] for r in rows if r["workload"] == w) for w in workloads]
        left.scatter(range(len(workloads)), optimum, marker="_", s=900, c="black", zorder=3,
                     label="analytic optimum")
        left.set_ylabel("prompt tokens served from the cache")
        right.set_ylabel("programs/s vs nano_vllm without prefix caching")
        right.set_yscale("log")
        right.axhline(1, ls=":", c="grey")
        for ax in (left, right):
            ax.set_xticks(range(len(workloads)), workloads)
            ax.grid(axis="y", alpha=0.3)
        left.set_ylim(0, 1.3)
        left.legend(fontsize=8, ncol=2, loc="upper center")
        _title(fig, f"RadixAttention: hit rate vs the optimum, throughput ({rec.get('model')})", rec)
        paths.append(_save(fig, _png(out, "sglang_hit_rate", name, records)))
    return paths


# ------------------------------------------------------------------ nano_quant: the quantized KV cache
KV_COLORS = ["fp8", "kivi4", "kivi2", "sdpa cudnn", "sdpa flash"]  # one color per dtype in every panel


def fig_kv(records: list[Record], out: Path) -> list[Path]:
    """nano_quant.bench_kv: each kv_cache_dtype against the 16-bit cache — the decode kernel's speedup per
    (heads, batch x context) case, nano_vllm's output tokens/s on the KV-limited workload, and the tokens
    a GiB of cache holds (the engine's sizing; hatched: computed, where the engine refused the dtype)."""
    paths = []
    for name, rec in records:
        panels = [p for p in ("kernel", "engine", "memory") if rec.get(p)]
        if not panels:
            raise KeyError("kernel / engine / memory")
        fig, axes = _grid(len(panels), 6.4, 4.4, columns=3)
        for ax, panel in zip(axes, panels):
            rows = rec[panel]
            if panel == "kernel":
                groups = list(dict.fromkeys((r["model"], r["batch"], r["context"]) for r in rows))
                labels = [f"{m}\n{b} x {c // 1024}k" if c >= 1024 else f"{m}\n{b} x {c}" for m, b, c in groups]
                key, ylabel = "vs auto", "decode kernel speed vs 16-bit (same page)"
            else:
                groups = list(dict.fromkeys(r["model"] for r in rows))
                labels = [str(m) for m in groups]
                key = "vs auto" if panel == "engine" else "tokens per GiB vs auto"
                ylabel = "output tok/s vs 16-bit" if panel == "engine" else "tokens per GiB vs 16-bit"
            dtypes = list(dict.fromkeys(r["kv_cache_dtype"] for r in rows if r["kv_cache_dtype"] != "auto"))
            width = 0.8 / max(len(dtypes), 1)
            for k, dtype in enumerate(dtypes):
                for i, g in enumerate(groups):
                    sel = [r for r in rows if r["kv_cache_dtype"] == dtype and
                           ((r["model"], r["batch"], r["context"]) if panel == "kernel" else r["model"]) == g]
                    computed = panel == "memory" and sel and _num(sel[0].get(key)) is None
                    v = _num(sel[0].get("tokens per GiB, computed vs auto" if computed else key)) if sel else None
                    if v is None:
                        continue
                    x = i + (k - (len(dtypes) - 1) / 2) * width
                    color = f"C{KV_COLORS.index(dtype)}" if dtype in KV_COLORS else f"C{5 + k}"
                    ax.bar(x, v, width, color=color, hatch="//" if computed else "", label=dtype)
                    ax.annotate(f"{v:.2f}", (x, v), ha="center", va="bottom", fontsize=7)
            ax.axhline(1, ls=":", c="grey")
            ax.set_xticks(range(len(groups)), labels, fontsize=8)
            ax.set_ylabel(ylabel)
            ax.set_ylim(bottom=0)
            ax.grid(axis="y", alpha=0.3)
            unique = dict(zip(*reversed(ax.get_legend_handles_labels())))  # a label per dtype
            ax.legend(unique.values(), unique.keys(), fontsize=7)
        quick = " (quick run: small shapes, says nothing about speed)" if rec.get("quick") else ""
        _title(fig, f"Quantized KV cache vs 16 bits: decode kernel, nano_vllm, memory{quick}", rec)
        paths.append(_save(fig, _png(out, "kv_cache", name, records)))
    return paths


# ------------------------------------------------------------------ nano_distserve
def fig_distserve(records: list[Record], out: Path) -> list[Path]:
    fig, axes = _grid(len(records), 6.2, 4.6)
    for ax, (_, rec) in zip(axes, records):
        rates, measured = rec["rates"], rec["mode"] == "measured"
        for i, row in enumerate(rec["systems"]):
            sim = row.get("sim_attainment") if measured else row["attainment"]
            if measured:
                ax.plot(rates, row["attainment"], marker="o", c=f"C{i}",
                        label=f"{row['system']} ({row['goodput_per_gpu']:g} req/s/GPU)")
            if sim:
                ax.plot(rates, sim, ls="--", c=f"C{i}",
                        label=None if measured else f"{row['system']} (simulated)")
        ax.axhline(0.9, ls=":", c="grey")
        w = rec.get("workload") or {}
        model = (rec.get("engine") or {}).get("model", "")
        gpus = rec["systems"][0].get("gpus", "?") if rec["systems"] else "?"
        slo = f"TTFT {w.get('ttft_slo', float('nan')):g} s, TPOT {w.get('tpot_slo', float('nan')):g} s"
        ax.set_title(f"{w.get('name', '?')}, {model}, {gpus} GPU(s) per system: {slo}\n{_where(rec)}",
                     fontsize=8)
        ax.set_xlabel("request rate (req/s, whole system)")
        ax.set_ylabel("SLO attainment (TTFT and TPOT)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, title="solid measured, dashed simulated" if measured else None,
                  title_fontsize=7)
    _title(fig, "DistServe: SLO attainment vs rate (goodput: the highest rate at 90%, dotted)", {})
    return [_save(fig, out / "distserve_slo.png")]


# ------------------------------------------------------------------ nano_specdec
def fig_specdec(records: list[Record], out: Path) -> list[Path]:
    """Per workload: the speedup over nano_vllm's plain decode (top; a projection for a larger target,
    when the record has one, dotted) and τ (bottom) against the batch size, a line per method and
    temperature (solid greedy, dashed sampled)."""
    import matplotlib.pyplot as plt

    paths = []
    for name, rec in records:
        rows = rec["rows"]
        if not rows:  # a run with no workload rows: nothing to draw
            continue
        workloads = list(dict.fromkeys(r["workload"] for r in rows))
        methods = list(dict.fromkeys(r["method"] for r in rows))
        series = list(dict.fromkeys((r["method"], r["temperature"]) for r in rows))
        cost = rec.get("cost") or {}
        fig, axes = plt.subplots(2, len(workloads), figsize=(4.6 * len(workloads), 7), squeeze=False,
                                 sharex=True)
        for j, workload in enumerate(workloads):
            top, bottom = axes[0][j], axes[1][j]
            for method, t in series:
                style = {"c": f"C{methods.index(method)}", "ls": "-" if t == 0 else "--"}
                sel = sorted((r for r in rows if (r["workload"], r["method"], r["temperature"]) ==
                              (workload, method, t)), key=lambda r: r["batch"])
                label = f"{method}, T={t:g}"
                for ax, key in ((top, "speedup"), (bottom, "tau")):
                    pts = [(r["batch"], _num(r.get(key))) for r in sel if _num(r.get(key)) is not None]
                    if pts:
                        ax.plot(*zip(*pts), marker="o", label=label, **style)
                proj = sorted((p["batch"], p["projected speedup"]) for p in cost.get("projection") or []
                              if (p["workload"], p["method"], p["temperature"]) == (workload, method, t))
                if proj:
                    top.plot(*zip(*proj), marker="x", ls=":", c=style["c"],
                             label=f"{label}: projection, {cost.get('model')}")
            top.axhline(1, ls=":", c="grey")
            top.set_title(workload, fontsize=10)
            top.set_ylabel("output tok/s vs plain decode")
            bottom.set_ylabel("τ: tokens per target forward")
            bottom.set_xlabel("batch size")
            batches = sorted({r["batch"] for r in rows})
            for ax in (top, bottom):
                ax.set_xscale("log", base=2)
                ax.set_xticks(batches, [str(b) for b in batches])
                ax.set_ylim(bottom=0)
                ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        quick = " (quick run: the tiny model as its own draft)" if rec.get("quick") else ""
        _title(fig, f"nano_specdec: speculative decoding against nano_vllm's plain decode, {rec.get('model')}, "
                    f"k = {rec.get('num_speculative_tokens')}{quick}", rec)
        paths.append(_save(fig, _png(out, "specdec_speedup", name, records)))
    return paths


FIGURES: dict[str, tuple[str, Callable[[list[Record], Path], list[Path]]]] = {
    "attention": ("flashattn", fig_attention), "decode": ("flashattn", fig_decode),
    "vllm": ("vllm", fig_vllm), "vllm_timeline": ("vllm", fig_vllm_timeline),
    "vllm_kernels": ("vllm", fig_vllm_kernels), "training": ("training", fig_training), "sglang": ("sglang", fig_sglang),
    "distserve": ("distserve", fig_distserve), "specdec": ("specdec", fig_specdec),
    "kv_cache": ("kv", fig_kv),
}


def shown_figures(root: Path = ROOT) -> set[str]:
    """The names of the PNGs in docs/img that a page of the repository shows: every `img/NAME.png` in a
    Markdown file outside hidden and output directories."""
    names: set[str] = set()
    for page in root.rglob("*.md"):
        parts = page.relative_to(root).parts
        if not any(p.startswith(".") or p in ("outputs", "node_modules") for p in parts[:-1]):
            names.update(PAGE_FIGURE.findall(page.read_text(encoding="utf-8", errors="replace")))
    return names


def render(results: Path, out: Path, only: list[str] | None = None) -> list[str]:
    """Draw every figure whose input is under `results` into `out`; returns one line per figure: what was
    written, or why it was skipped (no such JSON; a JSON without the fields the figure reads). Into
    docs/img, only the figures a page shows are kept (`shown_figures`); the others are named and removed."""
    try:
        import matplotlib
    except ImportError as e:
        raise ModuleNotFoundError(PLOT_HINT) from e
    matplotlib.use("Agg")
    unknown = sorted(set(only or []) - set(FIGURES))
    if unknown:
        raise ValueError(f"unknown figure(s) {unknown}; choose from {sorted(FIGURES)}")
    groups, lines = load_results(results)
    out.mkdir(parents=True, exist_ok=True)
    shown = shown_figures() if out.resolve() == DOCS_IMG else None  # None: keep every figure drawn
    for name, (kind, draw) in FIGURES.items():
        if only and name not in only:
            continue
        records = groups[kind]
        if not records:
            lines.append(f"skipped {name}: no {kind} JSON in {results} (run {SOURCES[kind]} and copy it "
                         "there)")
            continue
        try:
            paths = draw(records, out)
        except (KeyError, TypeError, IndexError) as e:
            lines.append(f"skipped {name}: {', '.join(n for n, _ in records)} lack(s) the field {e} it reads")
            continue
        kept = paths if shown is None else [p for p in paths if p.name in shown]
        for p in set(paths) - set(kept):
            p.unlink()
            lines.append(f"not kept {p}: no page shows it")
        lines += [f"wrote {p}" for p in kept] or \
            ([] if paths else [f"skipped {name}: its JSON holds no rows for it"])
    return lines


def build_parser() -> argparse.ArgumentParser:
    """The command line of `python -m shared.report`."""
    p = argparse.ArgumentParser(prog="python -m shared.report", description=__doc__.split("\n")[0])
    p.add_argument("--results", default="docs/results", help="directory of the benches' JSON files")
    p.add_argument("--out", default="docs/img", help="directory for the PNG figures")
    p.add_argument("--only", nargs="+", choices=sorted(FIGURES), help="draw only these figures")
    return p


def main(argv: list[str] | None = None) -> list[str]:
    args = build_parser().parse_args(argv)
    try:
        lines = render(Path(args.results), Path(args.out), args.only)
    except ModuleNotFoundError as e:
        if str(e) != PLOT_HINT:
            raise
        raise SystemExit(PLOT_HINT) from None
    print("\n".join(lines), flush=True)
    return lines


if __name__ == "__main__":
    main()
