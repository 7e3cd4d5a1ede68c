"""`python -m nano_vllm.bench fused_decode_sweep=true [model=qwen3-0.6b]` — the fused decoder layer's kernels
(nano_vllm/layers/fused_decode.py) at a model's shapes, over a grid of tile configs.

The five kernels of a layer run in the engine's order (QKV, attention over one sequence of 384 keys,
o_proj, gate/up, down) for every layer of the model, over that layer's own weights (random, as many as the
model has, so the chain reads HBM as a decode step does, not L2), inside one CUDA graph with the launch
options the engine uses (PDL where the "pdl" layer applies). Under PDL a kernel's cost depends on its
neighbours, so each kernel's configs are timed in the whole chain (µs a layer), the others at their current
choice; each kernel's best is kept before the next is swept; then the attention's split counts and key
tiles. Printed last: each kernel alone at the chosen config (its bandwidth: weight, input and output bytes
over its time, against the copy bandwidth measured in the same process), nano_flashattn's Flash-Decoding
beside the fused attention, the layer's µs and GB/s, and the chosen configs as lines of
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


def configs(k: int) -> list[fd.TileConfig]:
    """The grid: rows a program, the whole row or half of it a tile, 4 or 8 warps."""
    whole = 1 << (k - 1).bit_length()
    out = []
    for block_n, block_k, warps in itertools.product((1, 2, 4, 8, 16, 32), (whole, whole // 2), (4, 8)):
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
    slot = torch.tensor([5], device=dev)
    es = 2
    kinds = {  # name: (launch(config, layer), weight of layer 0, bytes a launch)
        "qkv": (lambda c, i: fd.norm_qkv(x, r, nw, 1e-6, wqkv[i], None, config=c),
                wqkv[0], (wqkv[0].numel() + 3 * hidden + wqkv[0].shape[0]) * es),
        "o_proj": (lambda c, i: fd.o_proj_residual(o, wo[i], x, r, config=c), wo[0],
                   (wo[0].numel() + hq * d + 3 * hidden) * es),
        "gate_up": (lambda c, i: fd.norm_gate_up_swiglu(x, nw, 1e-6, wgu[i], config=c), wgu[0],
                    (wgu[0].numel() + 2 * hidden + inter) * es),
        "down": (lambda c, i: fd.down(act, wd[i], config=c), wd[0],
                 (wd[0].numel() + inter + hidden) * es),
    }
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    shapes = {kind: (w.shape[0] // (2 if kind == "gate_up" else 1), w.shape[1]) for kind, (_, w, _) in kinds.items()}
    chosen = {kind: fd.tile_config(kind, *shapes[kind], sms) for kind in kinds}
    # the attention of the chain: one sequence of `context` keys, paged as the engine pages
    pages = 256
    kv = torch.randn(2, pages + 1, 16, hkv, d, device=dev, generator=g).to(dt)
    table = torch.arange(1, pages + 1, device=dev, dtype=torch.int32)[None]
    lens = torch.tensor([context], device=dev, dtype=torch.int32)
    qkv_attn = rand((hq + 2 * hkv) * d)
    attn = {"splits": fd.ATTENTION_SPLITS, "block_keys": fd.BLOCK_KEYS, "num_warps": fd.ATTENTION_WARPS}
    attn_ws = {}

    def attend(qkv, a):
        return fd.rope_store_attention(qkv, hq, cos, sin, qn, kn, 1e-6, kv[0], kv[1], slot, table[0], lens,
                                       attn_ws[a["splits"]], a["block_keys"], a["num_warps"])

    def chain(cfgs: dict, a: dict) -> float:
        """Seconds a layer: the five kernels of a layer in the engine's order, every layer's weights."""
        key = a["splits"]
        if key not in attn_ws:
            attn_ws[key] = fd.Workspace(hkv, hq // hkv, d, dev, splits=key)

        def body():
            for i in range(layers):
                attend(kinds["qkv"][0](cfgs["qkv"], i), a)
                for kind in ("o_proj", "gate_up", "down"):
                    kinds[kind][0](cfgs[kind], i)

        return _time_graph(body) / layers

    rows, best = [], {}
    # Each kernel's configs in the whole chain (the others at their current choice), since under PDL a kernel's
    # cost depends on its neighbours; then each kernel's best kept for the next.
    base = chain(chosen, attn)
    for kind, (_, w, _) in kinds.items():
        for c in configs(w.shape[1]):
            seconds = chain({**chosen, kind: c}, attn)
            row = {"kernel": kind, "N x K": f"{w.shape[0]}x{w.shape[1]}",
                   "tile": f"{c.block_n}x{c.block_k}/w{c.num_warps}", "us a layer": 1e6 * seconds,
                   "vs current": base / seconds, "current": c == chosen[kind]}
            rows.append(row)
            if kind not in best or seconds < best[kind][1]:
                best[kind] = (c, seconds, row)
        chosen[kind] = best[kind][0]
        base = best[kind][1]
    attn_rows = []
    for splits, block_keys in itertools.product((8, 16, 32), (16, 32, 64)):
        a = {"splits": splits, "block_keys": block_keys, "num_warps": attn["num_warps"]}
        attn_rows.append({"kernel": "fused_decode attention", "num_splits": splits, "block_keys": block_keys,
                          "num_warps": a["num_warps"], "context": context, "us a layer": 1e6 * chain(chosen, a)})
    best_attn = min(attn_rows, key=lambda r: r["us a layer"])
    for warps in (2, 4, 8):  # then the warps of the best tile (register footprint: what else fits on an SM)
        if warps != attn["num_warps"]:
            a = {"splits": best_attn["num_splits"], "block_keys": best_attn["block_keys"], "num_warps": warps}
            attn_rows.append({"kernel": "fused_decode attention", "num_splits": a["splits"],
                              "block_keys": a["block_keys"], "num_warps": warps, "context": context,
                              "us a layer": 1e6 * chain(chosen, a)})
    best_attn = min(attn_rows, key=lambda r: r["us a layer"])
    attn = {"splits": best_attn["num_splits"], "block_keys": best_attn["block_keys"],
            "num_warps": best_attn["num_warps"]}
    # each kernel alone at the chosen configs (its own graph over every layer's weights): its bandwidth
    alone = []
    for kind, (launch, _, nbytes) in kinds.items():
        seconds = _time_graph(lambda k=kind, launch=launch: [launch(chosen[k], i) for i in range(layers)]) / layers
        alone.append({"kernel": kind, "tile": f"{chosen[kind].block_n}x{chosen[kind].block_k}/w{chosen[kind].num_warps}",
                      "us": 1e6 * seconds, "GB/s": nbytes / seconds / 1e9,
                      "% of copy": 100 * nbytes / seconds / ceilings.copy_bytes_per_s})
    from nano_flashattn import flash_attn_with_kvcache

    q4 = qkv_attn[:hq * d].view(1, 1, hq, d)
    for splits in (0, 16):
        seconds = _time_graph(lambda s=splits: [flash_attn_with_kvcache(q4, kv[0], kv[1], lens, block_table=table,
                                                                        causal=True, num_splits=s)
                                                for _ in range(layers)]) / layers
        alone.append({"kernel": f"nano_flashattn decode (num_splits {splits or 'auto'})", "us": 1e6 * seconds})
    seconds = _time_graph(lambda: [attend(qkv_attn, attn) for _ in range(layers)]) / layers
    alone.append({"kernel": f"fused_decode attention ({attn['splits']} x {attn['block_keys']}/w{attn['num_warps']})",
                  "us": 1e6 * seconds})
    layer_bytes = sum(nbytes for _, _, nbytes in kinds.values())
    final = chain(chosen, attn)
    print_table(rows, title=f"fused decode kernels in a layer chain, {model} shapes, {layers} layers' weights, one "
                            f"CUDA graph each (the other kernels at their current config)")
    print_table(attn_rows, title="the chain with the attention's split counts and key tiles")
    print_table(alone, title="each kernel alone at the chosen config")
    print(f"a layer: {1e6 * final:.2f} us for {layer_bytes / 1e6:.2f} MB = {layer_bytes / final / 1e9:.0f} GB/s "
          f"({100 * layer_bytes / final / ceilings.copy_bytes_per_s:.0f}% of the measured copy)")
    print("chosen configs (fused_decode.MEASURED, ATTENTION_SPLITS, BLOCK_KEYS, ATTENTION_WARPS):")
    for kind, c in chosen.items():
        print(f'    ("{kind}", {shapes[kind][0]}, {shapes[kind][1]}): TileConfig({c.block_n}, {c.block_k}, '
              f"{c.num_warps}),")
    print(f"    attention: {attn}")
    return {"model": model, "rows": rows, "attention": attn_rows, "alone": alone, "layer_us": 1e6 * final,
            "layer_bytes": layer_bytes,
            "chosen": {kind: {"shape": list(shapes[kind]), "tile": [c.block_n, c.block_k, c.num_warps]}
                       for kind, c in chosen.items()}, "chosen_attention": attn}
