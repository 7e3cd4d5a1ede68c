"""`python -m nano_quant.bench_kv`: the quantized KV cache's speed and memory, each `kv_cache_dtype` against
the 16-bit cache in the same process.

    python -m nano_quant.bench_kv                       # GPU: the kernel, then the engine
    python -m nano_quant.bench_kv sections=[kernel]     # the decode attention kernel alone
    python -m nano_quant.bench_kv quick=true            # CPU-sized smoke run (automatic without CUDA)
    python -m nano_quant.bench_kv kernel.sweep=true     # first, each quantized kernel's tile configs

* **kernel** — Flash-Decoding (one new token per sequence) over a paged cache, at the attention heads of
  `kernel.models` (llama3-8b: 32 q / 8 kv heads of 128; qwen3-0.6b: 16 / 8 of 128), batch × context
  64 × 16k, 1 × 64k, 1 × 4k: nano_flashattn's kernel on the 16-bit cache and on FP8 codes (`k_scale` /
  `v_scale`) in pages of 16, on KIVI codes (`nano_flashattn.kivi`, found at run time; a note when absent)
  in pages of 32 — a page holds whole key groups — beside a 16-bit row at that page; torch SDPA's cuDNN
  and flash backends on a contiguous 16-bit cache. Time: `shared.bench.benchmark` (CUDA events, L2
  flushed, one call captured in a CUDA graph and replayed, as the engine runs its decode steps: an
  eager call's host work and value checks are not the kernel's); bytes: what the kernel must read (codes, scales and zero points, q, block table, output);
  GB/s and % of the device copy measured in the same process; speed against the 16-bit kernel at the
  same page; each output's error against the 16-bit kernel's (quantization error; a broken kernel shows).
* **engine** — a serving engine (`engine.api`: nano_vllm, imported by name at run time as in
  `nano_quant.kv_quality`) on a workload the KV cache limits: `num_requests` random prompts of
  `prompt_len` tokens, `output_len` greedy tokens each (ignore_eos), `kv_cache_memory_bytes` fixed so
  that the 16-bit cache holds `fit_seqs` whole sequences; every dtype gets the same bytes. Per dtype:
  output tokens/s and its ratio to auto, the blocks, tokens per GiB of that memory, how many whole
  sequences fit and the most that ran at once, preemptions. Decode steps run as CUDA graphs, steps with
  prompt tokens eagerly, for every dtype (KIVI's engine captures decode steps only). Models are presets
  with random weights (a format's speed does not depend on the values); `engine.layers` runs a preset's
  shapes with fewer decoder layers (weights and KV bytes per step shrink together).

Writes `bench_kv.json` to the run directory after every row (a run cut short keeps what it measured);
`python -m shared.report` draws it (kv_cache.png).
"""

from __future__ import annotations

import functools
import importlib
import math
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from nano_flashattn import flash_attn_with_kvcache
from nano_flashattn.registry import performance_layers
from shared.accounting import kv_cache_bytes
from shared.bench import (
    KernelCompiles,
    benchmark,
    format_rate,
    measure_copy_bandwidth,
    print_table,
    release_memory,
    report_oversubscription,
    write_json,
)
from shared.config import PRESETS, resolve_model_config
from shared.hydra_utils import hydra_run_dir

from .kv import FP8_MAX, KVCacheSpec, kv_bytes_per_token, parse_kv_cache_dtype, quantize_fp8
from .kv_quality import engine_cache, load_engine_api
from .perplexity import config_record

QUICK = {"kernel": {"models": ["llama3-8b"], "cases": [[2, 256], [1, 1024], [1, 128]]},
         "engine": {"models": ["tiny"], "layers": None, "prompt_len": 96, "output_len": 16, "fit_seqs": 2,
                    "num_requests": 6}, "warmup": 1, "repeats": 3}
PEERS = {"sdpa cudnn": "CUDNN_ATTENTION", "sdpa flash": "FLASH_ATTENTION"}


# ---------------------------------------------------------------------------------------------- kernel
def paged_cache(batch: int, context: int, heads_k: int, head_dim: int, page: int, dtype: torch.dtype,
                device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random K/V in a pool of pages (batch · context / page, page, heads_k, head_dim), each sequence's
    pages scattered by a random permutation (its block table)."""
    if context % page:
        raise ValueError(f"context ({context}) must be a multiple of the page size ({page})")
    gen = torch.Generator(device=device).manual_seed(seed)
    pages = batch * context // page
    shape = (pages, page, heads_k, head_dim)
    k = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    table = torch.randperm(pages, generator=gen, device=device).view(batch, -1).to(torch.int32)
    return {"k": k, "v": v, "table": table, "seqlens": torch.full((batch,), context, dtype=torch.int32,
                                                                   device=device)}


def fp8_codes(x: torch.Tensor, scale: torch.Tensor, chunk: int = 1 << 26) -> torch.Tensor:
    """`nano_quant.kv.quantize_fp8` a slice at a time (its fp32 temporary stays small)."""
    flat, out = x.view(-1), torch.empty(x.numel(), dtype=torch.float8_e4m3fn, device=x.device)
    for i in range(0, flat.numel(), chunk):
        out[i: i + chunk] = quantize_fp8(flat[i: i + chunk], scale)
    return out.view(x.shape)


def kivi_decode(spec: KVCacheSpec) -> tuple[Any, str | None]:
    """nano_flashattn's KIVI decode for `spec` as `make(q, cache) -> (callable, bytes read)`, or None and
    why not (nano_flashattn.kivi is found at run time: a fork of nano_flashattn may not have it)."""
    try:
        kivi = importlib.import_module("nano_flashattn.kivi")
        api = (kivi.KIVILayout, kivi.store_kv_kivi, kivi.flash_attn_with_kivi_cache)
    except (ImportError, AttributeError) as e:
        return None, f"{spec.name}: no KIVI decode in nano_flashattn ({type(e).__name__}: {e})"
    layout_cls, store, decode = api

    def make(q: torch.Tensor, c: dict, configs: list | None = None) -> tuple[Any, int]:
        """The same K/V written into a KIVI pool by `store_kv_kivi` (every row of every page at once;
        contexts are whole groups, so no key stays in the 16-bit tail), then Flash-Decoding over it;
        with `configs`, one Triton decode per tile config (kv_kivi's `config`) instead."""
        pages, page, heads, head_dim = c["k"].shape
        lay = layout_cls(spec.bits, spec.group_size, page, heads, head_dim)
        k_cache, v_cache = (torch.empty(pages, page, heads, lay.width, dtype=torch.uint8, device=q.device)
                            for _ in range(2))
        tail = torch.zeros(1, spec.group_size, heads, head_dim, dtype=q.dtype, device=q.device)
        tail_of_block = torch.zeros(pages, dtype=torch.int32, device=q.device)
        slots = torch.arange(pages * page, device=q.device)
        store(c["k"].flatten(0, 1), c["v"].flatten(0, 1), k_cache, v_cache, tail, slots, tail_of_block,
              spec.bits, spec.group_size)
        args = (q, k_cache, v_cache, tail, c["seqlens"], c["table"], tail_of_block, spec.bits,
                spec.group_size)
        nbytes = 2 * k_cache.numel() + 2 * q.numel() * q.element_size() + c["table"].numel() * 4
        if configs is not None:
            triton_decode = importlib.import_module("nano_flashattn.kv_kivi").flash_attn_with_kivi_cache_triton
            return [functools.partial(triton_decode, *args, causal=True, config=tuple(conf))
                    for conf in configs], nbytes
        return functools.partial(decode, *args, causal=True), nbytes

    return make, None


def sdpa_job(q: torch.Tensor, c: dict, backend: str) -> tuple[Any, int]:
    """torch SDPA over the same K/V made contiguous (batch, heads_k, context, head_dim), the GQA group
    folded into the query axis (nano_flashattn.bench's arrangement)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, _, hq, d = q.shape
    hk = c["k"].shape[2]
    k, v = (c[x][c["table"].long()].flatten(1, 2).transpose(1, 2).contiguous() for x in ("k", "v"))
    qs = q.view(b, hk, hq // hk, d)

    def run() -> torch.Tensor:
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return torch.nn.functional.scaled_dot_product_attention(qs, k, v)

    return run, 2 * k.numel() * k.element_size() + 2 * q.numel() * q.element_size()


def kernel_pages(cfg: DictConfig, specs: list[KVCacheSpec]) -> dict[int, list[KVCacheSpec]]:
    """page size -> the dtypes timed at it: `kernel.page` for each, except KIVI where its group does not
    divide the page (a page holds whole key groups): at the least common multiple, beside a 16-bit row
    of its own, so every ratio compares one page size."""
    page, g = int(cfg.kernel.page), int(cfg.kivi.group_size)
    pages: dict[int, list[KVCacheSpec]] = {page: []}
    for spec in specs:
        at = page if not spec.group_size or page % g == 0 else math.lcm(page, g)
        pages.setdefault(at, [parse_kv_cache_dtype("auto")] if at != page else []).append(spec)
    return {at: sorted(specs, key=lambda spec: spec.name != "auto") for at, specs in pages.items()}


def kernel_jobs(specs: list[KVCacheSpec], q: torch.Tensor, c: dict, small: int, kivi: dict) -> dict[str, Any]:
    """name -> (callable, bytes read), or a note saying why the dtype is not timed."""
    jobs: dict[str, Any] = {}
    for spec in specs:
        if spec.name == "auto":
            jobs["auto"] = (functools.partial(flash_attn_with_kvcache, q, c["k"], c["v"], c["seqlens"],
                                              block_table=c["table"], causal=True),
                            2 * c["k"].numel() * c["k"].element_size() + small)
        elif spec.name == "fp8":  # vLLM's per-tensor scale, amax / 448
            sk, sv = ((c[x].abs().amax().float() / FP8_MAX).reshape(1) for x in ("k", "v"))
            k8, v8 = fp8_codes(c["k"], sk), fp8_codes(c["v"], sv)
            jobs["fp8"] = (functools.partial(flash_attn_with_kvcache, q, k8, v8, c["seqlens"],
                                             block_table=c["table"], causal=True, k_scale=sk, v_scale=sv),
                           2 * k8.numel() + small)
        else:
            jobs[spec.name] = kivi[spec.name](q, c)
    return jobs


def kernel_rows(cfg: DictConfig, device: torch.device, copy: float, record: dict, save) -> None:
    """Every (head shape, case, page, dtype) row of the kernel section into record["kernel"]."""
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    g, r = int(cfg.kivi.group_size), int(cfg.kivi.residual)
    specs, kivi = [], {}
    for name in cfg.kv_cache_dtypes:
        spec = parse_kv_cache_dtype(str(name), None, g, r)
        if spec.group_size:
            make, why = kivi_decode(spec)
            if make is None:
                record["notes"].append(why)
                print(f"note: {why}", flush=True)
                continue
            kivi[spec.name] = make
        specs.append(spec)
    for model in cfg.kernel.models:
        mc = resolve_model_config(str(model))
        hq, hk, d = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
        for batch, context in cfg.kernel.cases:
            batch, context = int(batch), int(context)
            q = torch.randn(batch, 1, hq, d, device=device, dtype=dtype)
            for i, (page, at_page) in enumerate(kernel_pages(cfg, specs).items()):
                c = paged_cache(batch, context, hk, d, page, dtype, device)
                small = 2 * q.numel() * q.element_size() + c["table"].numel() * 4  # q, output, block table
                jobs = kernel_jobs(at_page, q, c, small, kivi)
                if cuda and cfg.kernel.peers and i == 0:
                    for peer, backend in PEERS.items():
                        try:
                            jobs[peer] = sdpa_job(q, c, backend)
                        except (RuntimeError, torch.OutOfMemoryError) as e:
                            jobs[peer] = f"{peer}: {str(e).splitlines()[0][:100]}"
                time_jobs(cfg, device, copy, record, jobs, q, {
                    "model": str(model), "heads": f"{hq}q/{hk}kv x {d}", "batch": batch, "context": context,
                    "page": page})
                save()
                del c, jobs
                release_memory()


def time_jobs(cfg: DictConfig, device: torch.device, copy: float, record: dict, jobs: dict, q: torch.Tensor,
              where: dict) -> None:
    """Time each job ("auto" first: the others' ratios and errors are against it); a refusal is a note."""
    ref, base = None, None
    for name, job in jobs.items():
        what = f"{name} at {where['model']} {where['batch']}x{where['context']}, page {where['page']}"
        if isinstance(job, str):
            record["notes"].append(job)
            print(f"note: {job}", flush=True)
            continue
        fn, nbytes = job
        try:
            out = fn().float().reshape(q.shape)
            t = benchmark(fn, warmup=int(cfg.warmup), repeats=int(cfg.repeats), device=device,
                          graph=device.type == "cuda")
        except (RuntimeError, ValueError, torch.OutOfMemoryError) as e:
            note = f"{what}: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            record["notes"].append(note)
            print(f"note: {note}", flush=True)
            continue
        ref, base = (out, t) if name == "auto" else (ref, base)
        row = {**where, "kv_cache_dtype": name, "us": t * 1e6, "bytes read": nbytes, "GB/s": nbytes / t / 1e9,
               "% of copy": 100 * nbytes / t / copy, "vs auto": base / t if base else None,
               "rel err vs auto": None if ref is None else
               float((out - ref).norm() / ref.norm().clamp(min=1e-30))}
        record["kernel"].append(row)
        print_table([row])


def sweep_rows(cfg: DictConfig, device: torch.device, record: dict, save) -> None:
    """`kernel.sweep`: each quantized dtype's decode at every `kernel.sweep_configs` entry of its kind
    (fp8: nano_flashattn.decode's (BLOCK_N, warps, stages); kivi: kv_kivi's, the same), at the first
    model's heads and the cases, the 16-bit kernel's default beside them; then, per
    dtype, the entry with the best geometric-mean speed over the cases (record["sweep_best"])."""
    from nano_flashattn.decode import decode_forward

    if device.type != "cuda":  # the configs are the Triton kernels' (on a CPU the torch path runs)
        record["notes"].append("kernel.sweep: needs a CUDA GPU")
        print("note: kernel.sweep needs a CUDA GPU", flush=True)
        return
    g = int(cfg.kivi.group_size)
    mc = resolve_model_config(str(cfg.kernel.models[0]))
    hq, hk, d = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
    page = math.lcm(int(cfg.kernel.page), g)
    record["sweep"], record["sweep_best"] = [], {}
    for batch, context in cfg.kernel.sweep_cases:
        q = torch.randn(int(batch), 1, hq, d, device=device, dtype=torch.bfloat16)
        c = paged_cache(int(batch), int(context), hk, d, page, torch.bfloat16, device)
        jobs: dict[tuple[str, tuple], Any] = {("auto", ()): functools.partial(
            flash_attn_with_kvcache, q, c["k"], c["v"], c["seqlens"], block_table=c["table"], causal=True)}
        for name in cfg.kv_cache_dtypes:
            spec = parse_kv_cache_dtype(str(name), None, g, int(cfg.kivi.residual))
            if spec.name == "fp8":
                sk, sv = ((c[x].abs().amax().float() / FP8_MAX).reshape(1) for x in ("k", "v"))
                k8, v8 = fp8_codes(c["k"], sk), fp8_codes(c["v"], sv)
                for conf in cfg.kernel.sweep_configs.fp8:
                    jobs["fp8", tuple(conf)] = functools.partial(
                        decode_forward, q, k8, v8, c["seqlens"], c["table"], d**-0.5, True, 0,
                        k_scale=sk, v_scale=sv, config=tuple(conf))
            elif spec.group_size:
                make, _ = kivi_decode(spec)
                if make is None:
                    continue
                confs = [list(conf) for conf in cfg.kernel.sweep_configs.kivi]
                for conf, run in zip(confs, make(q, c, confs)[0]):
                    jobs[spec.name, tuple(conf)] = run
        for (name, conf), fn in jobs.items():
            try:
                t = benchmark(fn, warmup=int(cfg.warmup), repeats=int(cfg.repeats), device=device,
                              graph=device.type == "cuda")
            except (RuntimeError, ValueError, torch.OutOfMemoryError) as e:
                print(f"note: sweep {name} {conf}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                continue
            row = {"kv_cache_dtype": name, "config": list(conf), "batch": int(batch),
                   "context": int(context), "page": page, "us": t * 1e6}
            record["sweep"].append(row)
            print_table([row])
            save()
        del c, jobs
        release_memory()
    cases = {(r["batch"], r["context"]) for r in record["sweep"]}
    for name in {r["kv_cache_dtype"] for r in record["sweep"]} - {"auto"}:
        times: dict[tuple, list[float]] = {}
        for r in record["sweep"]:
            if r["kv_cache_dtype"] == name:
                times.setdefault(tuple(r["config"]), []).append(r["us"])
        full = {conf: ts for conf, ts in times.items() if len(ts) == len(cases)}
        if full:
            best = min(full, key=lambda conf: math.prod(full[conf]))
            record["sweep_best"][name] = list(best)
            print(f"sweep: {name} best {list(best)}: "
                  + ", ".join(f"{t:.1f} us" for t in full[best]), flush=True)
    save()


# ---------------------------------------------------------------------------------------------- engine
def engine_model(model: str, layers: int | None) -> str:
    """`model`, or a preset of its shapes with `layers` decoder layers, registered for this process."""
    if layers is None or model not in PRESETS or layers >= PRESETS[model].num_hidden_layers:
        return model
    name = f"{model}-{layers}layers"
    PRESETS[name] = PRESETS[model].replace(num_hidden_layers=int(layers))
    return name


def timed_workload(api: ModuleType, llm: Any, prompts: list[dict], output_len: int,
                   device: torch.device) -> dict[str, Any]:
    """Two requests of 4 tokens (the kernels of these shapes built untimed), then every prompt, greedy,
    `output_len` tokens each: output tokens/s; with nano_vllm's scheduler also the most sequences that ran
    at once and the preemptions; the kernels built inside the timed run, by name."""
    params = api.SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    warm = api.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts[:2], warm, use_tqdm=False)
    engine = getattr(llm, "engine", None)
    scheduler = getattr(engine, "scheduler", None)
    peak, preempted = [0], getattr(scheduler, "num_preemptions", 0)
    if scheduler is not None and hasattr(engine, "step"):
        step = engine.step

        def counted_step():
            peak[0] = max(peak[0], len(scheduler.running))
            return step()

        engine.step = counted_step
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with KernelCompiles() as compiles:
        sync()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync()
        seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"prompt": len(prompts[0]["prompt_token_ids"]), "output": output_len, "requests": len(prompts),
            "output tok/s": tokens / seconds, "seconds": seconds, "vs auto": None,
            "most running": peak[0] if scheduler is not None else None,
            "preemptions": None if scheduler is None else scheduler.num_preemptions - preempted,
            "kernels built while timed": len(compiles.names) if compiles.available else None,
            "_kernel_variants": compiles.names}


def block_size(cfg: DictConfig) -> int:
    """The engine's block size for every dtype: 16, or the least common multiple with KIVI's group size
    where a KIVI dtype is measured (a block holds whole key groups)."""
    kivi = any(parse_kv_cache_dtype(str(d)).bits < 8 for d in cfg.kv_cache_dtypes)
    return math.lcm(16, int(cfg.kivi.group_size)) if kivi else 16


def engine_rows(cfg: DictConfig, device: torch.device, record: dict, save) -> None:
    """Every (model, dtype) row of the engine section into record["engine"] and record["memory"]."""
    e = cfg.engine
    p_len, o_len, fit, n_req = int(e.prompt_len), int(e.output_len), int(e.fit_seqs), int(e.num_requests)
    layers = list(e.layers) if e.layers is not None else [None] * len(e.models)
    if len(layers) != len(e.models):
        raise ValueError(f"engine.layers ({list(layers)}) must be null or one entry per engine.models model")
    api = load_engine_api(str(e.api))
    if api is None:
        record["notes"].append(f"the engine section needs a serving engine: engine.api={e.api!r} is not "
                               "installed")
        print(f"note: {record['notes'][-1]}", flush=True)
        return
    extra = OmegaConf.to_container(e.args, resolve=True) or {}
    bs = int(extra.pop("block_size", block_size(cfg)))
    itemsize = 2 if device.type == "cuda" else 4  # the engine's 16-bit cache: bf16 on a GPU, fp32 on a CPU
    for model, n_layers in zip(e.models, layers):
        name = engine_model(str(model), n_layers)
        mc = resolve_model_config(name)
        memory = fit * math.ceil((p_len + o_len) / bs) * kv_cache_bytes(mc, bs, dtype_bytes=itemsize)
        gen = torch.Generator().manual_seed(0)
        prompts = [{"prompt_token_ids": p}
                   for p in torch.randint(0, mc.vocab_size - 1, (n_req, p_len), generator=gen).tolist()]
        base = None
        for kv_dtype in cfg.kv_cache_dtypes:
            spec = parse_kv_cache_dtype(str(kv_dtype), bs, int(cfg.kivi.group_size), int(cfg.kivi.residual))
            computed = 2**30 / kv_bytes_per_token(spec, mc.num_hidden_layers, mc.num_key_value_heads,
                                                  mc.head_dim)
            memory_row = {"model": name, "kv_cache_dtype": spec.name, "tokens per GiB, computed": computed}
            record["memory"].append(memory_row)
            group = {"kv_cache_group_size": spec.group_size} if spec.group_size else {}  # nano_vllm's name
            try:
                llm = api.LLM(name, kv_cache_dtype=spec.name, **group, kv_cache_memory_bytes=memory,
                              max_model_len=p_len + o_len, block_size=bs, max_num_seqs=n_req,
                              max_num_batched_tokens=max(16384, n_req), enable_prefix_caching=False,
                              **({"device": str(device)} | extra))
            except ValueError as err:
                if spec.name == "auto":
                    raise
                record["notes"].append(f"engine {name}: refuses kv_cache_dtype={spec.name!r}: {err}")
                print(f"note: {record['notes'][-1]}", flush=True)
                continue
            row = {"model": name, "kv_cache_dtype": spec.name,
                   **timed_workload(api, llm, prompts, o_len, device)}
            cache = engine_cache(llm)
            if cache is not None:  # what the engine's sizing made of the same bytes
                tokens = cache["blocks"] * cache["block_size"]
                row.update({"blocks": cache["blocks"], "tokens per GiB": tokens * 2**30 / memory,
                            "whole sequences": tokens // (p_len + o_len)})
                memory_row.update({"tokens per GiB": row["tokens per GiB"],
                                   "block bytes": cache["block_bytes"]})
            base = row["output tok/s"] if spec.name == "auto" else base
            row["vs auto"] = row["output tok/s"] / base if base else None
            row["kv GiB"] = memory / 2**30
            record["engine"].append(row)
            print_table([row])
            save()
            getattr(llm, "shutdown", lambda: None)()
            del llm
            release_memory()
    for m in record["memory"]:
        auto = next((r for r in record["memory"]
                     if r["model"] == m["model"] and r["kv_cache_dtype"] == "auto"), {})
        for key in ("tokens per GiB", "tokens per GiB, computed"):
            if m.get(key) and auto.get(key):
                m[f"{key} vs auto"] = m[key] / auto[key]


# ---------------------------------------------------------------------------------------------- the run
TARGETS = {("kernel", "fp8"): 1.8, ("kernel", "kivi2"): 3.0, ("engine", "fp8"): 1.5, ("engine", "kivi2"): 2.0,
           ("memory", "fp8"): 1.95, ("memory", "kivi2"): 4.5}


def targets(record: dict) -> list[dict]:
    """Each target against its measured ratio: the kernel at batch 64 x 16k and 1 x 64k (1 x 4k: >= 0.9x
    for every dtype), the engine's output throughput and the tokens per GiB, against 16 bits."""
    out = []
    for r in record["kernel"]:
        if r["kv_cache_dtype"] in ("auto", "sdpa cudnn", "sdpa flash") or r.get("vs auto") is None:
            continue
        batch_1_4k = (r["batch"], r["context"]) == (1, 4096)
        goal = 0.9 if batch_1_4k else TARGETS.get(("kernel", r["kv_cache_dtype"]))
        if goal is not None:
            what = f"kernel {r['model']} {r['batch']}x{r['context']}"
            out.append({"what": what, "dtype": r["kv_cache_dtype"], "measured": r["vs auto"], "target": goal,
                        "met": r["vs auto"] >= goal})
    for section, key in (("engine", "vs auto"), ("memory", "tokens per GiB vs auto")):
        for r in record[section]:
            goal = TARGETS.get((section, r["kv_cache_dtype"]))
            if goal is not None and r.get(key) is not None:
                out.append({"what": f"{section} {r['model']}", "dtype": r["kv_cache_dtype"],
                            "measured": r[key], "target": goal, "met": r[key] >= goal})
    return out


def run(cfg: DictConfig) -> dict:
    """Everything `main` does, callable without Hydra (tests)."""
    with performance_layers(cfg.get("performance_layers", True)):
        cuda = torch.cuda.is_available()
        device = torch.device("cuda" if cuda else "cpu")
        quick = (not cuda) if cfg.quick is None else bool(cfg.quick)
        if quick:
            OmegaConf.set_struct(cfg, False)
            cfg = OmegaConf.merge(cfg, QUICK)
            print("note: quick run: small contexts and the tiny model; the numbers say nothing about speed",
                  flush=True)
        sections = list(cfg.sections)
        unknown = sorted(set(sections) - {"kernel", "engine"})
        if unknown:
            raise ValueError(f"sections {unknown} are unknown; choose from ['engine', 'kernel']")
        for name in cfg.kv_cache_dtypes:
            parse_kv_cache_dtype(str(name))
        if "auto" not in list(cfg.kv_cache_dtypes):
            raise ValueError(f"kv_cache_dtypes must include 'auto' (the 16-bit baseline), got "
                             f"{list(cfg.kv_cache_dtypes)}")
        report_oversubscription(device)
        copy = measure_copy_bandwidth(device)
        print(f"device copy: {format_rate(copy, 'B/s')} (read + write)", flush=True)
        path = Path(hydra_run_dir()) / "bench_kv.json"
        record = {"bench": "nano_quant.bench_kv", "device": str(device), "quick": quick,
                  "copy_GBps": copy / 1e9,
                  "kernel": [], "engine": [], "memory": [], "notes": [], "config": config_record(cfg)}

        def save() -> None:
            record["targets"] = [] if quick else targets(record)  # the targets are a GPU's
            write_json(path, record)

        if "kernel" in sections and cfg.kernel.get("sweep"):
            sweep_rows(cfg, device, record, save)
        if "kernel" in sections:
            kernel_rows(cfg, device, copy, record, save)
        if "engine" in sections:
            engine_rows(cfg, device, record, save)
        save()
        for title, rows in (("decode attention kernel, paged 16", record["kernel"]),
                            ("nano_vllm, KV-limited workload", record["engine"]),
                            ("tokens per GiB of KV cache", record["memory"]), ("targets", record["targets"])):
            if rows:
                print_table(rows, title=title)
        print(f"wrote {path}", flush=True)
        return record


@hydra.main(version_base=None, config_path="configs", config_name="bench_kv")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
