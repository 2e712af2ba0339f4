"""`deepfleet-worker` (worker/cli.py): the spec comes from --spec or DEEPFLEET_WORKER_SPEC; invalid specs,
bad flags and incomplete platform environments exit 64 with one line per problem and no traceback;
--check validates the spec and the node's environment without starting training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GOOD = {"job_id": "j", "entrypoint": {"script": "train.py"}, "nodes": {"min": 1, "max": 2}}


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DEEPFLEET_", "AZUREML_", "JOB_COMPLETION"))}
    return subprocess.run([sys.executable, "-m", "deepfleet.worker.cli", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env={**base, **(env or {})})


def test_check_reads_the_spec_from_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(GOOD))
    env = {"DEEPFLEET_WORKER_SPEC": str(path), "DEEPFLEET_NODE_RANK": "1", "DEEPFLEET_NNODES": "2",
           "DEEPFLEET_MASTER_ADDR": "10.1.2.3"}
    proc = _cli("--check", env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok: job j attempt 0, node 1 of 2 (local), 1 process(es), rendezvous 10.1.2.3:29400"


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (["--spec", '{"job_id": "j"}'], {}, ["deepfleet-worker: invalid spec: entrypoint: required; set it"]),
        ([], {}, ["deepfleet-worker: invalid spec: <spec>: none given; pass --spec PATH or set "
                  "DEEPFLEET_WORKER_SPEC to JSON or a path"]),
        (["--nope"], {}, ["deepfleet-worker: unrecognized arguments: --nope; see deepfleet-worker --help"]),
        (["--check", "--spec", json.dumps(GOOD)], {"JOB_COMPLETION_INDEX": "0"},
         ["deepfleet-worker: DEEPFLEET_K8S_JOB: not set; the backend must set it for this platform"]),
        (["--spec", json.dumps({**GOOD, "engine_config": {"train_batch_size": 0}})], {},
         None),  # checked below: the engine config is validated before any process starts
    ],
)
def test_bad_input_exits_64_with_one_line(args: list[str], env: dict, expected: list[str] | None) -> None:
    proc = _cli(*args, env=env)
    assert proc.returncode == 64, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    if expected is None:
        assert lines and all(ln.startswith("deepfleet-worker: invalid engine config: engine_config.") for ln in lines)
    else:
        assert lines == expected
