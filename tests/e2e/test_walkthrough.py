"""README's walkthrough, run as written: train with nano_megatron, serve with nano_vllm, ask with curl.

The three lines are read from README.md itself, so README and test cannot drift apart. Only the output
directory and the port are substituted (a temporary directory, a free port); the training runs the
README's 200 steps (~30 s here).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from shared.dist import find_free_port

ROOT = Path(__file__).resolve().parents[2]


def walkthrough_lines() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Walkthrough"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_readme_walkthrough_runs(tmp_path):
    train, serve, ask = walkthrough_lines()
    assert train.startswith("python -m nano_megatron.train") and serve.startswith("python -m nano_vllm.serve")
    assert ask.startswith("curl ")
    out, port = tmp_path / "walkthrough", find_free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    train = train.replace("outputs/walkthrough", str(out))
    proc = subprocess.run([sys.executable, *shlex.split(train)[1:]], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "checkpoint" / "config.json").is_file()
    serve = serve.rstrip("&").replace("outputs/walkthrough", str(out)).replace("port=8000", f"port={port}")
    server = subprocess.Popen([sys.executable, *shlex.split(serve)[1:], f"hydra.run.dir={tmp_path / 'serve'}"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    pytest.fail(f"server did not come up: {server.stdout.read()[-3000:]}")
                time.sleep(0.5)
        ask_args = shlex.split(ask.replace("localhost:8000", f"127.0.0.1:{port}"))
        if shutil.which("curl"):
            reply = subprocess.run(ask_args, capture_output=True, text=True, timeout=120).stdout
        else:  # the same request without curl
            body = ask_args[ask_args.index("-d") + 1].encode()
            url = next(a for a in ask_args if "/v1/" in a)
            req = urllib.request.Request(f"http://{url.removeprefix('http://')}", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                reply = r.read().decode()
        answer = json.loads(reply)
        assert answer["object"] == "chat.completion" and answer["model"] == "tiny"
        assert 1 <= answer["usage"]["completion_tokens"] <= 32  # 32 unless the model ends its turn first
        assert isinstance(answer["choices"][0]["message"]["content"], str)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
