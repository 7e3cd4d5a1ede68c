"""Hydra configs of `python -m nano_specdec.serve` and `python -m nano_specdec.bench` (shipped inside the package)."""
