"""nano_sglang's benchmark — off the paper path: `python -m nano_sglang.bench` runs `programs.run` (§6:
synthetic LLM programs on the radix cache against nano_vllm's hash prefix cache and against no prefix
cache; JSON decoding with and without jump-forward) with configs/bench.yaml."""
