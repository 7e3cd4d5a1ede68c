"""Workload presets of `python -m nano_vllm.bench` (`workload=nano_vllm` default, `batch1`, `batch16`, `prefill`)."""
