"""`python -m nano_vllm.bench.quant` — one bench workload served 16-bit and quantized, in one process.

Each entry of `methods` is one `nano_vllm.bench` run of the same workload and engine arguments with that
`quantization` (null: the 16-bit model; rtn-w4: AWQ's W4A16 g128 format; naive-w8a8, naive-fp8: W8A8
INT8 / e4m3), the model quantized on the fly by nano_quant; then a table of what each method's weights
take, the KV blocks the engine's sizing gave the cache from what was left (§5), and throughput against
the 16-bit run. The speed of a quantized format does not depend on how its values were chosen, so a
random-weight preset measures AWQ's and SmoothQuant's serving speed. Writes `bench_quant.json` (every
run's full bench record) to the run directory.

    python -m nano_vllm.bench.quant model=llama3-8b workload=batch1 engine.max_num_seqs=16 methods=[null,rtn-w4]
    python -m nano_vllm.bench.quant model=llama3-8b workload=batch16 engine.max_num_seqs=16 methods=[null,rtn-w4]
    python -m nano_vllm.bench.quant model=llama3-8b workload=prefill methods=[null,naive-w8a8,naive-fp8]
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from nano_vllm.bench.throughput import run
from nano_vllm.loadgen import nano_vllm_workload
from shared.bench import print_table, write_json
from shared.hydra_utils import hydra_run_dir


def compare(cfg: DictConfig) -> dict:
    """Run the bench once per entry of `cfg.methods` (the first is the baseline); print and return the
    comparison."""
    if cfg.get("quantization") is not None:
        raise ValueError(f"quantization={cfg.quantization!r}: bench_quant sets it per run from `methods`; "
                         "list the methods instead, e.g. methods=[null,rtn-w4]")
    methods = list(cfg.methods)
    if not methods:
        raise ValueError("methods must name at least one run (null: the 16-bit model)")
    records = []
    for method in methods:
        print(f"\n=== quantization={method} ===", flush=True)
        records.append(run(OmegaConf.merge(cfg, {"quantization": method})))
    rows = []
    for method, rec in zip(methods, records):
        ours, mem = rec["rows"][0], rec["memory"]
        rows.append({"quantization": method or rec["dtype"], "weights GiB": mem["weights_GiB"],
                     "KV blocks": mem["kv_blocks"], "KV GiB": mem["kv_cache_GiB"],
                     "output tok/s": ours["output tok/s"],
                     "total tok/s": (ours["output tokens"] + prompt_tokens(rec)) / ours["seconds"],
                     "seconds": ours["seconds"]})
    base = rows[0]["quantization"]
    for r in rows:
        r[f"speed vs {base}"] = rows[0]["seconds"] / r["seconds"]
        r[f"KV blocks vs {base}"] = r["KV blocks"] / rows[0]["KV blocks"]
    record = {"bench": "nano_vllm.bench.quant", "model": str(cfg.model), "methods": methods, "rows": rows,
              "runs": records}
    path = Path(hydra_run_dir()) / "bench_quant.json"
    write_json(path, record)
    first = records[0]
    print_table(rows, title=f"nano_vllm, quantized on the fly: {first['model']}, {first['workload']['num_seqs']} "
                            f"requests, {first['dtype']} activations on {first['device']}")
    print(f"wrote {path}", flush=True)
    return record


def prompt_tokens(record: dict) -> int:
    """The prompt tokens of a bench record's workload: as recorded (after fitting the workload to the
    model), else regenerated from its recorded parameters and seed."""
    if record.get("prompt_tokens") is not None:
        return int(record["prompt_tokens"])
    w = record["workload"]
    reqs = nano_vllm_workload(w["num_seqs"], w["min_input_len"], w["max_input_len"], w["min_output_len"],
                              w["max_output_len"], w["vocab"], w["temperature"], w["seed"])
    return sum(len(r.prompt) for r in reqs)


@hydra.main(version_base=None, config_path="../configs", config_name="bench_quant")
def main(cfg: DictConfig) -> None:
    compare(cfg)


if __name__ == "__main__":
    main()
