"""`deepfleet serve CHECKPOINT` end to end: the CLI starts the server on a port it binds itself
(port 0), a completion comes back, and bad invocations exit 2 with one line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from examples.gpt.model import GPTConfig, GPTWithLoss

# Each case starts a Python process that imports torch (and one a server): ~20-45 s on a shared 2-core box.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
KWARGS = {"vocab_size": 300, "seq_len": 32, "d_model": 32, "n_heads": 4, "n_layers": 2}


def _weights(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    model = GPTWithLoss(GPTConfig(**KWARGS))
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    return path


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "deepfleet.controller.cli", "serve", *args]


def test_serve_cli_answers_a_completion(tmp_path):
    path = _weights(tmp_path)
    proc = subprocess.Popen(_cli(str(path), "--model", "examples.gpt.factories:build", "--model-kwargs",
                                 json.dumps({**KWARGS, "num_samples": 8}), "--port", "0", "--max-out-tokens", "32"),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "DEEPFLEET_SERVE_API_KEY": "sk-test"})
    try:
        port, deadline, seen = None, time.monotonic() + 120, []
        while port is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            seen.append(line)
            match = re.search(r"running on http://127\.0\.0\.1:(\d+)", line)
            port = int(match.group(1)) if match else None
        assert port, "".join(seen)
        def request(headers: dict) -> urllib.request.Request:
            return urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions", method="POST", headers={"content-type": "application/json",
                                                                                   **headers},
                data=json.dumps({"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}).encode())

        # the key comes from DEEPFLEET_SERVE_API_KEY: a request without it is refused
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request({}), timeout=60)
        assert refused.value.code == 401
        refused.value.close()  # the error holds the response and its socket
        with urllib.request.urlopen(request({"Authorization": "Bearer sk-test"}), timeout=60) as r:
            body = json.loads(r.read())
        assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "length"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        proc.stdout.close()


def test_serve_cli_bad_invocations_exit_2_with_one_line(tmp_path):
    path = _weights(tmp_path)
    r = subprocess.run(_cli(str(path)), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().startswith("error: --model: a deepfleet checkpoint holds only tensors")
    assert len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run(_cli(str(tmp_path / "none.safetensors"), "--model", "examples.gpt.factories:build"),
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "checkpoint: " in r.stderr and "no such file" in r.stderr
