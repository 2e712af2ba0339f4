"""examples/gpt: the DeepSpeed-style script runs as a job's script entrypoint under the worker (2
processes, ZeRO stage 2 from ds_config.json), prints progress and leaves a complete checkpoint; a
second run resumes from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _worker(spec: dict) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "deepfleet.worker.cli", "--spec", json.dumps(spec)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.e2e
@pytest.mark.slow
def test_example_script_under_the_worker_trains_and_resumes(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    tiny = ["--d-model", "32", "--layers", "1", "--seq-len", "16", "--checkpoint-dir", str(ckpt), "--save-every", "2"]
    spec = {"job_id": "gpt", "processes_per_node": 2,
            "entrypoint": {"script": "examples/gpt/train.py", "args": ["--steps", "3", *tiny]},
            "rendezvous": {"port": 0, "last_call_timeout_s": 2}, "restart": {"max_restarts": 0}}
    proc = _worker(spec)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [ln.split(" loss")[0] for ln in proc.stdout.splitlines() if ln.startswith("step ")] == [
        "step 1/3", "step 2/3", "step 3/3"]
    assert (ckpt / "latest").read_text().strip() == "global_step3" and (ckpt / "global_step3" / "COMPLETE").exists()

    spec["entrypoint"]["args"] = ["--steps", "4", *tiny]
    proc = _worker(spec)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "global_step3 at step 3" in proc.stdout and "step 4/4" in proc.stdout
