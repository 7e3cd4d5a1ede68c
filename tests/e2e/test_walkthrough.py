"""README's walkthrough, run as written: train with nano_megatron, serve with nano_vllm in the background,
wait for `/health`, ask with curl.

The lines are read from README.md itself, so README and test cannot drift apart, and run by bash in a
temporary directory (where the README's relative `outputs/walkthrough` lands). Only the port is
substituted (a free one); the wait loop's `sleep 1` is bounded (it also stops once the server has exited or
after 300 tries), and the server is stopped (SIGTERM: it drains and exits) when the script ends. The
training runs the README's 200 steps (~30 s here).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from shared.dist import find_free_port

ROOT = Path(__file__).resolve().parents[2]
BOUNDED_SLEEP = 'sleep 1; kill -0 "$SERVER" || exit 97; [ "$((TRIES += 1))" -lt 300 ] || exit 98'


def walkthrough_lines() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Walkthrough"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_readme_walkthrough_runs(tmp_path):
    train, serve, wait, ask = walkthrough_lines()
    assert train.startswith("python -m nano_megatron.train") and serve.startswith("python -m nano_vllm.serve")
    assert serve.endswith("&") and wait.startswith("until curl ") and "/health" in wait and ask.startswith("curl ")
    assert "do sleep 1; done" in wait
    if shutil.which("curl") is None or shutil.which("bash") is None:
        pytest.skip("the walkthrough's lines need bash and curl")
    port = find_free_port()
    serve, wait, ask = (line.replace("port=8000", f"port={port}").replace("localhost:8000", f"localhost:{port}")
                        for line in (serve, wait, ask))
    script = "\n".join([
        "set -e", train, serve, "SERVER=$!",
        'trap \'echo; kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null || true\' EXIT',
        wait.replace("do sleep 1; done", f"do {BOUNDED_SLEEP}; done"), ask])
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen(["bash", "-c", script], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=1200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output[-3000:]
    assert (tmp_path / "outputs" / "walkthrough" / "checkpoint" / "config.json").is_file()
    answers = [json.loads(line) for line in output.splitlines() if line.startswith('{"id"')]
    assert len(answers) == 1, output[-3000:]
    answer = answers[0]
    assert answer["object"] == "chat.completion" and answer["model"] == "tiny"
    assert 1 <= answer["usage"]["completion_tokens"] <= 32  # 32 unless the model ends its turn first
    assert isinstance(answer["choices"][0]["message"]["content"], str)
