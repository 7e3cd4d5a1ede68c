"""`python -m shared.bench`: the shared kernels' and the model's benchmark (shared.bench_kernels)."""

from shared.bench_kernels import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    main()
