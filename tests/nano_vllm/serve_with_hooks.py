"""`python -m nano_vllm.serve` with two test hooks, for test_server_process.py:

    python tests/nano_vllm/serve_with_hooks.py HOOK_DIR key=value ...

runs the module `nano_vllm.serve` as `__main__` with the given overrides — what `python -m nano_vllm.serve
key=value ...` runs — after installing hooks that files in HOOK_DIR drive. A test creates and removes the
files; the hooks wait on them, so nothing depends on timing:

* while HOOK_DIR/hold_steps exists, each engine step waits before it runs (creating HOOK_DIR/step_held as
  it starts waiting): an engine loop stuck in a step;
* every tokenization first writes the text's length to a new HOOK_DIR/encode-<id> file, then, while
  HOOK_DIR/hold_tokenizer exists, waits: a tokenizer busy with a huge prompt.
"""

from __future__ import annotations

import runpy
import sys
import time
import uuid
from pathlib import Path

POLL_S = 0.01


def _wait_while(path: Path) -> None:
    while path.exists():
        time.sleep(POLL_S)


def install(hooks: Path) -> None:
    from nano_vllm.engine import LLMEngine
    from nano_vllm.tokenizer import HFTokenizer, SharedTokenizer

    step = LLMEngine.step

    def held_step(self):
        if (hooks / "hold_steps").exists():
            (hooks / "step_held").touch()
            _wait_while(hooks / "hold_steps")
        return step(self)

    LLMEngine.step = held_step
    for cls in (SharedTokenizer, HFTokenizer):
        encode = cls.encode

        def held_encode(self, text: str, _encode=encode) -> list[int]:
            (hooks / f"encode-{uuid.uuid4().hex}").write_text(str(len(text)))
            _wait_while(hooks / "hold_tokenizer")
            return _encode(self, text)

        cls.encode = held_encode


if __name__ == "__main__":
    install(Path(sys.argv[1]))
    sys.argv = ["nano_vllm.serve", *sys.argv[2:]]
    runpy.run_module("nano_vllm.serve", run_name="__main__", alter_sys=True)
