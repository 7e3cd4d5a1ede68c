"""Workload presets of `python -m nano_vllm.bench` (`workload=nano_vllm` default, `workload=batch1`)."""
