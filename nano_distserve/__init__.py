"""nano_distserve: DistServe (arXiv 2401.09670) — prefill/decode disaggregation on top of nano_vllm.

Instances (`instance.py`) and KV transfer (`kv_transfer.py`) run nano_vllm's scheduler and model runner by
phase; `disagg.py` launches them as processes; `goodput.py` / `workloads.py` measure against SLOs;
`simulator.py` and `planner.py` are §4.1's placement search; `bench.py` is the benchmark.
"""
