"""nano_vllm's benchmarks and measurement — off the paper path.

* `python -m nano_vllm.bench` — offline throughput on nano-vllm's published workload (`throughput.py`,
  configs/bench.yaml); `gemv=true`: the decode GEMV against cuBLAS (`gemv.py`);
* `python -m nano_vllm.bench.quant` — the bench once per quantization method (`quant.py`);
* `step_timing.py` — `StepTimer`, where each engine step's time goes (also nano_sglang's and
  nano_distserve's benches).
"""
