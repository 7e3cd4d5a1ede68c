"""nano_distserve: DistServe (arXiv 2401.09670) — prefill/decode disaggregation on top of nano_vllm.

The paper path: `protocol.py` (the pull's messages), `instance.py` (prefill and decode instances over
nano_vllm's scheduler and model runner), `kv_transfer.py` (block export/import, leases), `goodput.py`,
`simulator.py` and `planner.py` (§4.1's placement search). Beside it: `disagg.py` runs the instances as
processes, `transport.py` connects them over torch.distributed, `workloads.py` holds Table 1; `bench/` is
the benchmark (`python -m nano_distserve.bench`) with the measurement it and the tests read.
"""
