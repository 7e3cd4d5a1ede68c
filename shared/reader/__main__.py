"""`python -m shared.reader --out site/`: the annotated reader (see shared/reader/__init__.py)."""

from shared.reader import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    main()
