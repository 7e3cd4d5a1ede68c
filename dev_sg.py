import random, time, sys, collections, torch
from nano_sglang.bench import make_programs, run_programs
from nano_sglang.engine import SGLEngine
from nano_sglang.scheduler import CacheAwareConfig
from nano_vllm.config import EngineConfig
from shared.bench import release_memory
from omegaconf import OmegaConf
cfg = OmegaConf.load("nano_sglang/configs/bench.yaml")
args = {k: v for k, v in OmegaConf.to_container(cfg.engine).items() if v is not None}
for mixed in ([64, 128, 256, 512], []):
    args["mixed_cudagraph_sizes"] = mixed
    eng = SGLEngine(EngineConfig(model="llama3-8b", **args), CacheAwareConfig("lpm"))
    r = eng.model_runner
    log = []
    orig = r.run
    def timed(inputs, orig=orig):
        torch.cuda.synchronize(); t = time.perf_counter()
        kind = "decode" if inputs["is_decode"] else (f"mixed{r._mixed_size(inputs)}" if r._mixed_size(inputs) else "eager")
        out = orig(inputs); torch.cuda.synchronize()
        log.append((kind, len(inputs["ids"]), time.perf_counter() - t)); return out
    r.run = timed
    for name in ["kshot", "chat"]:
        progs = make_programs(name, dict(cfg.shapes[name]), random.Random(0), 4000)
        run_programs(eng, progs[:1])
        for rep in range(3):
            log.clear(); s0 = eng.num_steps
            row = run_programs(eng, progs)
            agg = collections.defaultdict(lambda: [0, 0, 0.0, 0.0])
            for k, n, t in log:
                a = agg[k]; a[0] += 1; a[1] += n; a[2] += t; a[3] = max(a[3], t)
            print(f"mixed={mixed} {name} rep{rep}: {row['seconds']:.3f}s steps={eng.num_steps-s0} " +
                  " ".join(f"{k}:n={v[0]},tok={v[1]},sum={v[2]*1e3:.0f}ms,max={v[3]*1e3:.1f}ms" for k, v in sorted(agg.items())), flush=True)
    del eng, r; release_memory()
