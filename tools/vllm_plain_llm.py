"""The published workload as a user of the Python API runs it: nano-vllm's bench.py with our `LLM`.

    python tools/vllm_plain_llm.py                      # the qwen3-0.6b preset (random weights)
    python tools/vllm_plain_llm.py --paper-path         # LLM(..., performance_layers=False)
    python tools/vllm_plain_llm.py --model /path/to/Qwen3-0.6B

What a new user writes, and nothing more: `from nano_vllm import LLM, SamplingParams`, nano-vllm's random
draws (`random.seed(0)`; 256 prompts of `randint(100, 1024)` ids `randint(0, 10000)`, then
`max_tokens = randint(100, 1024)` each; temperature 0.6, `ignore_eos`: 133,966 output tokens), its one
short warm-up request, then `llm.generate` timed. Prints the output tokens, seconds and output tokens/s,
and the performance layers the engine applied. Put beside `python -m nano_vllm.bench` in one GPU call, it
measures what a plain `LLM` gives against the bench (which adds a warm-up on 32 workload prompts and its
step timing).
"""

from __future__ import annotations

import argparse
import random
import time

from nano_vllm import LLM, SamplingParams


def workload(num_seqs: int = 256, min_input_len: int = 100, max_input_len: int = 1024,
             min_output_len: int = 100, max_output_len: int = 1024, vocab: int = 10000,
             seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """nano-vllm's bench.py draws: every prompt first, then every request's max_tokens."""
    random.seed(seed)
    prompt_token_ids = [[random.randint(0, vocab)
                         for _ in range(random.randint(min_input_len, max_input_len))]
                        for _ in range(num_seqs)]
    sampling_params = [SamplingParams(temperature=0.6, ignore_eos=True,
                                      max_tokens=random.randint(min_output_len, max_output_len))
                       for _ in range(num_seqs)]
    return prompt_token_ids, sampling_params


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b", help="a shared.config preset or an HF checkpoint")
    parser.add_argument("--paper-path", action="store_true", help="performance_layers=False")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--min-input-len", type=int, default=100)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--min-output-len", type=int, default=100)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=10000, help="prompt ids are drawn from [0, vocab]")
    parser.add_argument("--max-model-len", type=int, default=4096)
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    prompt_token_ids, sampling_params = workload(args.num_seqs, args.min_input_len, args.max_input_len,
                                                 args.min_output_len, args.max_output_len, args.vocab)
    extra = {"performance_layers": False} if args.paper_path else {}
    llm = LLM(args.model, max_model_len=args.max_model_len, **extra)
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
    t = time.perf_counter()
    outputs = llm.generate(prompt_token_ids, sampling_params, use_tqdm=False)
    t = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outputs)
    layers = llm.engine.layers_applied
    print(f"layers applied: {', '.join(layers) or 'none'}")
    print(f"Total: {tokens}tok, Time: {t:.2f}s, Throughput: {tokens / t:.2f}tok/s", flush=True)
    llm.shutdown()
    return {"output_tokens": tokens, "seconds": t, "output_tok_per_s": tokens / t, "layers_applied": layers}


if __name__ == "__main__":
    main()
