"""`python -m nano_vllm.bench` — offline throughput on nano-vllm's published workload (a Hydra app:
nano_vllm/bench/__main__.py).

Default workload (nano-vllm's bench.py, draw for draw): `random.seed(0)`; 256 prompts of `randint(100, 1024)`
token ids `randint(0, 10000)`; then `max_tokens = randint(100, 1024)` each; temperature 0.6, ignore_eos;
Qwen3-0.6B shape with random weights; 133,966 output tokens. Before timing, a warm-up: nano-vllm's one
short request, then the first 32 workload prompts with 2 output tokens each (the real prefill and mixed-step
shapes, so no Triton kernel is compiled inside the timed run). Prints output tokens, seconds, output
tokens/s and the fraction of a roofline estimate, writes `bench.json` to the run directory.

The roofline (`shared.accounting.serving_roofline`) is a lower bound on the workload's time on this device:
the prefill at the measured matmul peak, plus every decode step at max(bytes / bandwidth, FLOPs / peak),
where a step reads the bytes it actually reads — every matmul weight once, one gathered embedding row per
sequence, the K/V of every key — all sequences decoding together (so it ignores what batching limits add).
Bandwidth is the read-only stream (a kernel that only reads, as a decode step does; the copy, which
counts a write per read, where that is not measured) and peak the bf16 matmul, measured once at process
start, before the engine takes the memory (`shared.bench.measure_ceilings`), beside the datasheet values.

The engine is a plain `LLM` of the config's model and `engine:` keys: fast by default (every performance
layer that applies, nano_vllm/layers/), `performance_layers=false` the paper path alone, and
`engine.<switch>=false` one layer off; the layers it applied are printed beside the step timing and
written to bench.json (`layers_applied`). `step_timing.StepTimer` splits the timed run's steps into
schedule, execute (prepare included) and postprocess, and its timeline gives host busy, device busy and
device idle time per step (`timeline` in bench.json, drawn by `python -m shared.report`).

    python -m nano_vllm.bench                              # GPU: the workload above
    python -m nano_vllm.bench peer=transformers            # + transformers continuous batching, same run
    python -m nano_vllm.bench model=llama3-8b workload=batch1 peer=compiled   # + gpt-fast's compiled decode
    python -m nano_vllm.bench model=llama3-8b workload=batch1   # batch-1 decode, % of memory bandwidth
    python -m nano_vllm.bench serving_rate=20              # + open-loop serving at 20 req/s: TTFT / TPOT
    python -m nano_vllm.bench engine.async_scheduling=false   # one layer off (each engine.* layer key)
    python -m nano_vllm.bench performance_layers=false     # the paper path alone
    python -m nano_vllm.bench workload=batch1 pdl=false    # every kernel without programmatic dependent launch
    python -m nano_vllm.bench gemv=true                    # the decode GEMV vs cuBLAS and torch.compile
    python -m nano_vllm.bench fused_decode_sweep=true      # the fused decoder layer's kernels over tile configs
    python -m nano_vllm.bench quick=true                   # a CPU-sized smoke run (automatic without CUDA)
    python -m nano_vllm.bench quantization=rtn-w4          # quantized on the fly (or model=a quantized checkpoint)

The weights' memory and the KV blocks it left are printed (`kv_cache_summary`) and recorded (`memory`);
the roofline stays the 16-bit model's, so a quantized run can pass 100% of it.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from nano_vllm.bench.kernel_profile import profile_decode
from nano_vllm.bench.step_timing import StepTimer
from nano_vllm.config import EngineConfig, engine_args_from
from nano_vllm.engine import LLM
from nano_vllm.kv_cache import kv_cache_summary, weight_bytes
from nano_vllm.loadgen import Request, nano_vllm_workload, poisson_arrivals, run_engine_open_loop
from nano_vllm.metrics import summarize
from nano_vllm.sampling_params import SamplingParams
from shared.accounting import format_rate, serving_roofline
from shared.bench import (
    KernelCompiles,
    measure_ceilings,
    print_table,
    release_memory,
    report_oversubscription,
    write_json,
)
from shared.config import resolve_model_config
from shared.hydra_utils import hydra_run_dir

# Without a GPU the default would take hours: a tiny model and a few short requests instead.
QUICK = {"model": "tiny", "workload": {"num_seqs": 8, "min_input_len": 16, "max_input_len": 64,
                                       "min_output_len": 16, "max_output_len": 48, "vocab": 4000},
         "engine": {"max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 256},
         # transformers sizes its cache from "free memory" otherwise: 20 s of allocation on a CPU
         "peer_config": {"num_blocks": 64, "max_batch_tokens": 256}}


def _workload(w: DictConfig) -> list[Request]:
    return nano_vllm_workload(int(w.num_seqs), int(w.min_input_len), int(w.max_input_len), int(w.min_output_len),
                              int(w.max_output_len), int(w.vocab), float(w.temperature), int(w.seed))


def fit_workload(reqs: list[Request], vocab_size: int, max_model_len: int) -> tuple[list[Request], list[str]]:
    """The workload as drawn where the model takes it, else fitted to the model, with a note per change:
    token ids past the vocabulary folded into it (`id % vocab_size`: every other draw stays the published
    one), and a request longer than `max_model_len` cut (its prompt to `max_model_len - 1` tokens, then
    its `max_tokens` to what is left)."""
    notes = []
    top = max((max(r.prompt) for r in reqs if r.prompt), default=0)
    if top >= vocab_size:
        reqs = [Request([t % vocab_size for t in r.prompt], r.sampling_params) for r in reqs]
        notes.append(f"note: the workload's token ids (up to {top}) are folded into the model's vocabulary of "
                     f"{vocab_size} (id % {vocab_size}); lengths and every other draw are the published ones")
    cut, fitted = 0, []
    for r in reqs:
        prompt, sp = r.prompt[:max_model_len - 1], r.sampling_params
        if len(prompt) + sp.max_tokens > max_model_len:
            sp = replace(sp, max_tokens=max_model_len - len(prompt))
        changed = len(prompt) < len(r.prompt) or sp is not r.sampling_params
        cut += changed
        fitted.append(Request(prompt, sp) if changed else r)
    if cut:
        notes.append(f"note: {cut} of {len(reqs)} requests are longer than max_model_len ({max_model_len}): "
                     f"cut to fit (prompt to {max_model_len - 1} tokens at most, then max_tokens to the rest)")
    return fitted, notes


def engine_args(cfg: DictConfig) -> dict:
    """The engine arguments of the config (its `engine:` keys, `quantization`, `performance_layers`)."""
    engine = OmegaConf.to_container(cfg.engine, resolve=True)
    if cfg.get("quantization") is not None:
        engine["quantization"] = str(cfg.quantization)
    if cfg.get("performance_layers") is not None:
        engine["performance_layers"] = bool(cfg.performance_layers)
    return engine_args_from(engine)


def make_llm(cfg: DictConfig) -> LLM:
    """`LLM` of the config's model and engine arguments (`quantization` and `performance_layers` among
    them): what a user's `LLM(model, **engine_args)` builds."""
    return LLM(str(cfg.model), **engine_args(cfg))


def run_ours(cfg: DictConfig, reqs: list[Request]) -> tuple[dict, LLM]:
    llm = make_llm(cfg)
    print(kv_cache_summary(llm.engine.model_runner), flush=True)
    if cfg.warmup:  # nano-vllm's one short request, plus a slice of the workload with 2 output tokens each:
        # large prefill chunks and mixed steps of the real shapes, so no Triton compilation is timed
        llm.generate(["Benchmark: "], SamplingParams(max_tokens=16), use_tqdm=False)
        llm.generate([r.prompt for r in reqs[:32]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        llm.engine.block_manager.reset_prefix_cache()  # the timed run must not hit the warm-up's prompts
    sync()
    timer = StepTimer(llm.engine, timeline=True)
    with KernelCompiles() as compiles:  # any Triton compilation inside the timed run is a bench defect
        t0 = time.perf_counter()
        outs = llm.generate([r.prompt for r in reqs], [r.sampling_params for r in reqs],
                            use_tqdm=bool(cfg.progress))
        sync()
        seconds = time.perf_counter() - t0
    print(f"timed run: {compiles.summary()}", flush=True)
    timer.remove()
    tokens = sum(len(o.token_ids) for o in outs)
    steps, phases = max(timer.num_steps, 1), timer.seconds
    layers = llm.engine.layers_applied
    print(f"layers applied: {', '.join(layers) or 'none'}", flush=True)
    print("per step (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in timer.per_step_ms().items())
          + "  (execute includes prepare, the launches and the wait for the sampled tokens; 0 when steps "
            "overlap, which launch and wait apart)", flush=True)
    timeline = timer.timeline.summary()
    print(f"timeline per step (ms): host busy {timeline['host_busy_ms_per_step']:.3f}, device busy "
          f"{timeline['device_busy_ms_per_step']:.3f}, device idle {timeline['device_idle_ms_per_step']:.3f} "
          f"(device busy {100 * timeline['device_busy_frac']:.1f}% of the run)", flush=True)
    row = {"system": "nano_vllm", "requests": len(reqs), "output tokens": tokens, "seconds": seconds,
           "output tok/s": tokens / seconds, "steps": steps,
           "preemptions": llm.engine.scheduler.num_preemptions,
           "kernels built while timed": len(compiles.names) if compiles.available else None}
    row["_layers_applied"] = list(layers)
    row["_tokens"] = list(outs[0].token_ids) if len(outs) == 1 else None  # for the batch-1 peer's comparison
    row["_kernel_variants"] = compiles.reprs  # full signatures, for bench.json (not printed: "_" prefix)
    runner = llm.engine.model_runner  # what the weights take and what §5's sizing left to KV blocks
    qcfg = getattr(runner.model, "quantization_config", None)
    row["_memory"] = {"quantization": llm.engine.config.quantization,
                      "quantization_config": qcfg.to_dict() if qcfg is not None else None,
                      "weights_GiB": weight_bytes(runner.model) / 2**30, "kv_blocks": runner.num_blocks,
                      "kv_cache_GiB": runner.num_blocks * runner.block_bytes * runner.tp_size / 2**30}
    row["_stored"] = stored_bytes(llm)
    row["_timeline"] = {"summary": timeline, "window": timer.timeline.window(int(cfg.timeline_steps))}
    profile_steps = cfg.get("profile_steps")
    if profile_steps is None:  # on for batch-1 workloads (where a step is a few hundred kernels), on CUDA
        profile_steps = 32 if len(reqs) == 1 and torch.cuda.is_available() else 0
    if int(profile_steps) > 0:
        row["_kernel_profile"] = profile_decode(llm, list(reqs[0].prompt), steps=int(profile_steps))
    row["ms/step"] = 1e3 * seconds / steps
    row["host ms/step"] = 1e3 * (phases["schedule"] + phases["postprocess"] + phases["prepare"]) / steps
    row["device idle ms/step"] = timeline["device_idle_ms_per_step"]
    repeats = int(cfg.get("repeats") if cfg.get("repeats") is not None else 1)
    if repeats > 1:  # the spread, not the best run: the row gives the median and the range of all runs
        runs = [row["output tok/s"]]
        for _ in range(repeats - 1):
            llm.engine.block_manager.reset_prefix_cache()  # each run starts as the first did
            sync()
            t0 = time.perf_counter()
            again = llm.generate([r.prompt for r in reqs], [r.sampling_params for r in reqs], use_tqdm=False)
            sync()
            runs.append(sum(len(o.token_ids) for o in again) / (time.perf_counter() - t0))
        row["output tok/s"], row["runs"] = statistics.median(runs), repeats
        row["min tok/s"], row["max tok/s"] = min(runs), max(runs)
        row["_runs_tok_per_s"] = runs  # every run, for bench.json (the first one's timing above)
        print(f"{repeats} runs: output tok/s median {row['output tok/s']:,.1f}, range {min(runs):,.1f}–"
              f"{max(runs):,.1f} ({100 * (max(runs) - min(runs)) / row['output tok/s']:.1f}% of the median)",
              flush=True)
    return row, llm


def stored_bytes(llm: LLM) -> dict:
    """What a decode step of this engine reads where it differs from 16 bits, for the roofline
    (shared.accounting.decode_bytes): a quantized model's matmul weights as stored (codes, scales, zeros;
    the untied input-embedding table, of which a step reads one row a sequence, left out), and a
    quantized KV cache's bytes per element (a block's bytes over its elements)."""
    runner, config, out = llm.engine.model_runner, llm.engine.config, {}
    mcfg = runner.model_config
    if config.quantization is not None:
        table = runner.model.model.embed_tokens.weight
        untied = 0 if mcfg.tie_word_embeddings else table.numel() * table.element_size()
        out["weight_bytes"] = (weight_bytes(runner.model) - untied) * runner.tp_size
    if config.kv_cache_dtype not in (None, "auto"):
        elements = runner.block_size * 2 * mcfg.num_hidden_layers * runner.num_kv_heads * mcfg.head_dim
        out["kv_dtype_bytes"] = runner.block_bytes / elements
    return out


def run_transformers(cfg: DictConfig, reqs: list[Request], device: str, dtype: torch.dtype) -> dict:
    """transformers' continuous batching (`ContinuousBatchingManager`) on the same requests and weights."""
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    mcfg = resolve_model_config(str(cfg.model))
    if Path(str(cfg.model)).is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(cfg.model), dtype=dtype)
    else:  # the same random weights our engine ran (same preset, same seed)
        from shared.model import build_model

        hf_cfg = transformers.AutoConfig.for_model(**mcfg.to_hf())
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
        ours = build_model(mcfg, device="cpu", dtype=dtype, seed=int(cfg.engine.get("seed") or 0))
        model.load_state_dict(ours.state_dict(), strict=False)
        del ours
    model = model.to(device).eval()
    temp = reqs[0].sampling_params.temperature
    gen = GenerationConfig(do_sample=temp > 0, temperature=temp or None, top_k=0, top_p=1.0, eos_token_id=-1,
                           max_new_tokens=max(r.sampling_params.max_tokens for r in reqs))
    cb = ContinuousBatchingConfig(**OmegaConf.to_container(cfg.peer_config, resolve=True))
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                   warmup=bool(cfg.warmup)) as manager:
        sync()
        t0 = time.perf_counter()
        ids = [manager.add_request(r.prompt, max_new_tokens=r.sampling_params.max_tokens, eos_token_id=-1)
               for r in reqs]
        done: dict[str, int] = {}
        while len(done) < len(ids):
            result = manager.get_result(timeout=600)
            if result is None:
                raise RuntimeError("transformers continuous batching stalled for 600 s")
            if result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"transformers request {result.request_id} failed: {result.error}")
                done[result.request_id] = len(result.generated_tokens)
        sync()
        seconds = time.perf_counter() - t0
    tokens = sum(done.values())
    return {"system": f"transformers {transformers.__version__} CB", "requests": len(reqs),
            "output tokens": tokens, "seconds": seconds, "output tok/s": tokens / seconds}


def _command_line() -> DictConfig:
    """The `key=value` overrides of this Hydra run (empty outside one), config-group choices excluded."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return OmegaConf.create()
    items = [o.lstrip("+") for o in HydraConfig.get().overrides.task if not o.startswith("~")]
    return OmegaConf.from_dotlist([o for o in items if o.split("=")[0] not in ("workload", "model")
                                   and not o.startswith("hydra.")])


def print_kernel_profile(p: dict) -> None:
    """The per-kernel table of a decode profile, then its largest bubbles."""
    print_table([{k: v for k, v in r.items()} for r in p["kernels"][:16]],
                title=f"decode step, per kernel ({p['steps']} steps profiled; {p['kernels/step']:.0f} kernels a step, "
                      f"device span {p['device span us/step']:.0f} us, busy {p['device busy us/step']:.0f} us, "
                      f"bubbles {p['bubbles us/step']:.0f} us)")
    print_table(p["gaps"], title="largest bubbles between kernels (per step)")


def disable_pdl() -> None:
    """nano_flashattn's "pdl" layer off (its `disable()`): every kernel launches without programmatic
    dependent launch; says so when the layer is not there (a fork deleted it: nothing to turn off)."""
    try:
        from nano_flashattn.layers import pdl
    except ImportError:
        print("note: pdl=false: nano_flashattn's pdl layer is not installed; nothing to turn off", flush=True)
        return
    pdl.disable()
    print("note: pdl=false: programmatic dependent launch off for every kernel", flush=True)


def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def run(cfg: DictConfig) -> dict:
    cuda = torch.cuda.is_available() and str(cfg.engine.get("device") or "cuda").startswith("cuda")
    quick = (not cuda) if cfg.quick is None else bool(cfg.quick)
    device = "cuda" if cuda else "cpu"
    oversubscribed = report_oversubscription(device)  # on a CPU: torch's threads against the free cores
    # The ceilings first, on an empty device: every fraction below is of this one measurement.
    ceilings = measure_ceilings(device)
    print(ceilings.describe(), flush=True)
    if cfg.gemv:
        from nano_vllm.bench.gemv import run_gemv

        record = run_gemv(cfg, ceilings, device, interpreter=os.environ.get("TRITON_INTERPRET") == "1")
        path = Path(hydra_run_dir()) / "bench.json"
        write_json(path, record)
        print(f"wrote {path}", flush=True)
        return record
    if cfg.get("fused_decode_sweep"):
        from nano_vllm.bench.fused_decode import run_fused_decode_sweep

        record = run_fused_decode_sweep(str(cfg.model), ceilings)
        path = Path(hydra_run_dir()) / "bench.json"
        write_json(path, {"bench": "nano_vllm.fused_decode_sweep", "ceilings": ceilings.as_dict(), **record})
        print(f"wrote {path}", flush=True)
        return record
    if quick:  # QUICK replaces the defaults, what was given on the command line still wins
        OmegaConf.set_struct(cfg, False)
        one = {"workload": {"num_seqs": 1}} if int(cfg.workload.num_seqs) == 1 else {}  # batch 1 stays batch 1
        cfg = OmegaConf.merge(cfg, {k: v for k, v in QUICK.items() if k != "model"},
                              {"model": QUICK["model"]} if cfg.model == "qwen3-0.6b" else {}, one, _command_line())
        print("note: quick run (no GPU, or quick=true): the tiny model and a few short requests instead of the "
              "published workload (256 requests, Qwen3-0.6B shape, 133,966 output tokens); numbers from this run "
              "say nothing about GPU throughput", flush=True)
    mcfg = resolve_model_config(str(cfg.model))
    max_model_len = EngineConfig(model=str(cfg.model), **engine_args(cfg)).resolve_max_model_len(mcfg)
    reqs, notes = fit_workload(_workload(cfg.workload), mcfg.vocab_size, max_model_len)
    if cfg.get("logprobs") is not None:  # every request also asks for its tokens' log-probabilities
        reqs = [Request(r.prompt, replace(r.sampling_params, logprobs=int(cfg.logprobs))) for r in reqs]
        notes.append(f"note: every request asks for logprobs={int(cfg.logprobs)} (the published workload asks "
                     f"for none)")
    for note in notes:
        print(note, flush=True)
    bandwidth, peak = ceilings.stream_bytes_per_s, ceilings.matmul_flops_per_s
    if cfg.get("repeats") is not None and int(cfg.repeats) < 1:
        raise ValueError(f"repeats must be >= 1 (timed runs of the workload), got {cfg.repeats}")
    if cfg.peer == "compiled" and len(reqs) != 1:  # before the engine runs, not after
        raise ValueError(f"peer=compiled decodes one request (workload=batch1); this workload has {len(reqs)}")
    if cfg.get("pdl") is False:  # what programmatic dependent launch buys: every kernel launched without it
        disable_pdl()
    row, llm = run_ours(cfg, reqs)
    timeline, memory, layers = row.pop("_timeline"), row.pop("_memory"), row.pop("_layers_applied")
    stored = row.pop("_stored")  # a quantized model's or cache's bytes: what its decode steps read
    kernel_profile = row.pop("_kernel_profile", None)
    our_tokens = row.pop("_tokens")
    dtype = llm.engine.config.torch_dtype
    llm.shutdown()  # tensor-parallel workers too
    del llm
    release_memory()
    prompt_lens = [len(r.prompt) for r in reqs]
    out_lens = [r.sampling_params.max_tokens for r in reqs]
    bound = serving_roofline(mcfg, prompt_lens, out_lens, dtype.itemsize, bandwidth, peak, **stored)
    bound["roofline_reads"] = stored or "16-bit weights and K/V"
    row["% of roofline"] = 100 * row["output tok/s"] / bound["roofline_tok_per_s"]
    if ceilings.datasheet_bytes_per_s:  # the same bound at the card's datasheet bandwidth (the datasheet floor)
        sheet = serving_roofline(mcfg, prompt_lens, out_lens, dtype.itemsize, ceilings.datasheet_bytes_per_s,
                                 peak, **stored)
        bound["datasheet_roofline_tok_per_s"] = sheet["roofline_tok_per_s"]
        row["% of datasheet floor"] = 100 * row["output tok/s"] / sheet["roofline_tok_per_s"]
    rows = [row]
    if cfg.serving_rate is not None:  # open-loop serving on a fresh engine: TTFT / TPOT under load
        llm = make_llm(cfg)
        metrics, seconds = run_engine_open_loop(llm.engine, reqs, poisson_arrivals(len(reqs), float(cfg.serving_rate)))
        serving = summarize(metrics, seconds)
        print_table([{k: v for k, v in serving.items() if "p90" not in k and "normalized" not in k}],
                    title=f"open-loop serving, Poisson arrivals at {cfg.serving_rate} req/s (seconds)")
        llm.shutdown()
        del llm
        release_memory()
    else:
        serving = None
    if cfg.peer == "transformers":
        n = int(cfg.peer_num_seqs or len(reqs))
        peer = run_transformers(cfg, reqs[:n], device, dtype)
        peer_bound = serving_roofline(mcfg, prompt_lens[:n], out_lens[:n], dtype.itemsize, bandwidth, peak)
        peer["% of roofline"] = 100 * peer["output tok/s"] / peer_bound["roofline_tok_per_s"]
        rows.append(peer)
        for r in rows:
            r["vs transformers"] = r["output tok/s"] / peer["output tok/s"]
    elif cfg.peer == "compiled":  # gpt-fast's compiled decode of the same model: the batch-1 peer
        from nano_vllm.bench.compiled_decode import run_compiled_decode

        sp = reqs[0].sampling_params
        peer = run_compiled_decode(mcfg, list(reqs[0].prompt), int(sp.max_tokens), device, dtype,
                                   str(cfg.get("peer_compile_mode") or "max-autotune"), int(cfg.engine.seed or 0))
        theirs = peer.pop("_tokens")
        same = next((i for i, (a, b) in enumerate(zip(theirs, our_tokens or [], strict=False)) if a != b),
                    min(len(theirs), len(our_tokens or [])))
        if sp.temperature == 0:
            print(f"greedy tokens: the compiled peer and nano_vllm agree on the first {same} of {len(theirs)} "
                  "(bf16: a near-tie may part them)", flush=True)
        peer["tokens equal to ours before the first difference"] = same
        peer["% of roofline"] = 100 * peer["output tok/s"] / bound["roofline_tok_per_s"]
        if "datasheet_roofline_tok_per_s" in bound:
            peer["% of datasheet floor"] = 100 * peer["output tok/s"] / bound["datasheet_roofline_tok_per_s"]
        rows.append(peer)
        for r in rows:
            r["vs compiled"] = r["output tok/s"] / peer["output tok/s"]
        release_memory()
    elif cfg.peer is not None:
        raise ValueError(f"peer must be null, 'transformers' or 'compiled', got {cfg.peer!r}")
    record = {"bench": "nano_vllm", "model": str(cfg.model), "device": device, "dtype": str(dtype).removeprefix("torch."),
              "quick": quick, "workload": OmegaConf.to_container(cfg.workload), "engine":
              OmegaConf.to_container(cfg.engine), "ceilings": ceilings.as_dict(), "copy_GBps": ceilings.copy_bytes_per_s / 1e9,
              "roofline_GBps": bandwidth / 1e9,
              "matmul_TFLOPs": peak / 1e12, "layers_applied": layers, "pdl": cfg.get("pdl"),
              "performance_layers": dict.fromkeys(layers, True),  # what shared.report labels a figure with
              **bound, "rows": rows, "serving": serving, "timeline": timeline, "memory": memory,
              "workload_notes": notes, "prompt_tokens": sum(prompt_lens), "oversubscription": oversubscribed,
              "kernel_profile": kernel_profile}
    path = Path(hydra_run_dir()) / "bench.json"
    write_json(path, record)
    if kernel_profile and kernel_profile.get("available"):
        print_kernel_profile(kernel_profile)
    print_table(rows, title=f"nano_vllm bench: {cfg.model}, {len(reqs)} requests, {sum(out_lens):,} output tokens, "
                            f"{record['dtype']} on {device}")
    print(f"roofline: {bound['roofline_tok_per_s']:,.0f} output tok/s ({bound['roofline_s']:.3g} s: prefill "
          f"{bound['prefill_bound_s']:.3g} s at {format_rate(peak, 'FLOP/s')}, decode {bound['decode_bound_s']:.3g} s "
          f"at {format_rate(bandwidth, 'B/s')} read-only stream bandwidth, {100 * bound['decode_memory_bound_frac']:.0f}% of decode "
          f"steps memory-bound; bytes actually read)\nwrote {path}", flush=True)
    return record
