"""`python -m nano_vllm.bench fused_decode_sweep=true [model=qwen3-0.6b]` — the fused decoder layer's kernels
(nano_vllm/layers/fused_decode.py) alone, at a model's shapes, over a grid of tile configs; and Flash-Decoding
at batch 1 over split counts.

Each kernel runs once per layer of the model, over that layer's own weights (random, as many as the model
has, so the sweep reads HBM as a decode step does, not L2), back to back inside one CUDA graph with the
launch options the engine uses (PDL where the "pdl" layer applies). Printed per kernel and config: µs per
launch and the bandwidth it reached (its weight, input and output bytes over its time), against the copy
bandwidth measured in the same process; the best config of each kernel is marked, in the form of
`fused_decode.MEASURED` ready to paste.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from nano_vllm.layers import fused_decode as fd
from shared.bench import print_table
from shared.config import resolve_model_config


def _time_graph(body, reps: int = 20) -> float:
    """Seconds per replay of a CUDA graph of `body` (run once before capture: compiles, warms up)."""
    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def configs(k: int, head_dim: int | None) -> list[fd.TileConfig]:
    """The grid: rows a program, the whole row or half of it a tile, 4 or 8 warps."""
    whole = 1 << (k - 1).bit_length()
    out = []
    for block_n, block_k, warps in itertools.product((1, 2, 4, 8, 16), (whole, whole // 2), (4, 8)):
        if head_dim is not None and head_dim % block_n:
            continue
        if block_n * block_k > 32768 or block_k < 256:  # 64 KiB of bf16 a tile at most
            continue
        out.append(fd.TileConfig(block_n, block_k, warps))
    return out


def run_fused_decode_sweep(model: str, ceilings: Any, context: int = 384) -> dict:
    cfg = resolve_model_config(model)
    dev, dt = torch.device("cuda"), torch.bfloat16
    layers, hidden, d = cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim
    hq, hkv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(dt)

    wqkv = [rand((hq + 2 * hkv) * d, hidden, scale=hidden**-0.5) for _ in range(layers)]
    wo = [rand(hidden, hq * d, scale=(hq * d) ** -0.5) for _ in range(layers)]
    wgu = [rand(2 * inter, hidden, scale=hidden**-0.5) for _ in range(layers)]
    wd = [rand(hidden, inter, scale=inter**-0.5) for _ in range(layers)]
    x, r, nw = rand(hidden), rand(hidden), torch.ones(hidden, device=dev, dtype=dt)
    o, act = rand(hq * d), rand(inter)
    qn = kn = torch.ones(d, device=dev, dtype=dt) if cfg.qk_norm else None
    cos, sin = torch.ones(d // 2, device=dev), torch.zeros(d // 2, device=dev)
    caches = torch.zeros(2, 64, 16, hkv, d, device=dev, dtype=dt)
    slot = torch.tensor([5], device=dev)
    ws = fd.Workspace(wqkv[0].shape[0], wqkv[0].shape[0] // d, dev)
    es = 2
    kinds = {
        "qkv": (lambda c, i: fd.norm_qkv_rope_store(x, r, nw, 1e-6, wqkv[i], None, cos, sin, hq, hkv, qn, kn,
                                                    1e-6, caches[0], caches[1], slot, ws, config=c),
                wqkv[0], d, (wqkv[0].numel() + 3 * hidden) * es),
        "o_proj": (lambda c, i: fd.o_proj_residual(o, wo[i], x, r, config=c), wo[0], None,
                   (wo[0].numel() + hq * d + 3 * hidden) * es),
        "gate_up": (lambda c, i: fd.norm_gate_up_swiglu(x, nw, 1e-6, wgu[i], config=c), wgu[0], None,
                    (wgu[0].numel() + 2 * hidden + inter) * es),
        "down": (lambda c, i: fd.down(act, wd[i], config=c), wd[0], None,
                 (wd[0].numel() + inter + hidden) * es),
    }
    rows, best = [], {}
    for kind, (launch, w, head_dim, nbytes) in kinds.items():
        n, k = w.shape
        if kind == "gate_up":
            n //= 2
        default = fd.tile_config(kind, n, k, torch.cuda.get_device_properties(dev).multi_processor_count)
        for c in configs(k, head_dim):
            seconds = _time_graph(lambda c=c, launch=launch: [launch(c, i) for i in range(layers)]) / layers
            row = {"kernel": kind, "N x K": f"{w.shape[0]}x{k}", "config": f"{c.block_n}x{c.block_k}/w{c.num_warps}",
                   "us": 1e6 * seconds, "GB/s": nbytes / seconds / 1e9,
                   "% of copy": 100 * nbytes / seconds / ceilings.copy_bytes_per_s, "default": c == default}
            rows.append(row)
            if kind not in best or row["us"] < best[kind][1]["us"]:
                best[kind] = (c, row)
    # Flash-Decoding at batch 1: one sequence of `context` keys in a paged cache as wide as the engine's
    from nano_flashattn import flash_attn_with_kvcache

    pages = 256
    kv = torch.randn(2, pages + 1, 16, hkv, d, device=dev, generator=g).to(dt)
    table = torch.arange(1, pages + 1, device=dev, dtype=torch.int32)[None]
    lens = torch.tensor([context], device=dev, dtype=torch.int32)
    q = rand(1, 1, hq, d)
    attn_rows = []
    for splits in (0, 8, 16, 32, 64, 128, 256):
        seconds = _time_graph(lambda s=splits: [flash_attn_with_kvcache(q, kv[0], kv[1], lens, block_table=table,
                                                                        causal=True, num_splits=s)
                                                for _ in range(layers)]) / layers
        attn_rows.append({"kernel": "nano_flashattn", "num_splits": splits or "auto", "block_keys": "-",
                          "context": context, "us": 1e6 * seconds})
    q2 = q.view(hq, d)
    for splits, block_keys in itertools.product((8, 16, 32, 64), (16, 32, 64)):
        aws = fd.Workspace(1, 1, dev, hkv, hq // hkv, d, splits=splits)
        seconds = _time_graph(lambda w=aws, b=block_keys: [fd.decode_attention(q2, kv[0], kv[1], table[0], lens, w, b)
                                                          for _ in range(layers)]) / layers
        attn_rows.append({"kernel": "fused_decode", "num_splits": splits, "block_keys": block_keys,
                          "context": context, "us": 1e6 * seconds})
    print_table(rows, title=f"fused decode kernels, {model} shapes, {layers} layers' weights, one CUDA graph each")
    print_table(attn_rows, title=f"Flash-Decoding, batch 1, {hq}/{hkv} heads of {d}, {pages * 16}-key block table")
    print("best configs (fused_decode.MEASURED):")
    for kind, (c, row) in best.items():
        n, k = (int(v) for v in row["N x K"].split("x"))
        n = n // 2 if kind == "gate_up" else n
        print(f'    ("{kind}", {n}, {k}): TileConfig({c.block_n}, {c.block_k}, {c.num_warps}),  # '
              f"{row['us']:.2f} us, {row['GB/s']:.0f} GB/s")
    return {"model": model, "rows": rows, "attention": attn_rows,
            "best": {k: {"config": [c.block_n, c.block_k, c.num_warps], **row} for k, (c, row) in best.items()},
            "best_attention": min((r for r in attn_rows if r["kernel"] == "fused_decode"), key=lambda r: r["us"])}
