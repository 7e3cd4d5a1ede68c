"""Hydra configs of `python -m nano_vllm.bench` and `python -m nano_vllm.serve` (shipped inside the package)."""
