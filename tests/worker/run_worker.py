"""The one way worker tests run `deepfleet-worker --spec <json>` as a subprocess: its output is streamed
line by line to an optional `on_line(proc, line)` callback (to signal or kill it at a chosen step), and
its whole process group is killed if it outlives `timeout`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKER = [sys.executable, "-m", "deepfleet.worker.cli"]


def run_worker(spec: dict, *, timeout: float, wait_s: float, on_line: Callable | None = None,
               extra_env: dict | None = None, args: list[str] | None = None) -> tuple[int, str]:
    """(exit code, combined output) of one worker run from the repository root (`args`: more options)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    with subprocess.Popen([*WORKER, "--spec", json.dumps(spec), *(args or [])], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True) as proc:
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                if on_line is not None:
                    on_line(proc, line)
                if time.monotonic() > deadline:
                    raise TimeoutError("worker did not finish:\n" + "".join(lines[-40:]))
            return proc.wait(timeout=wait_s), "".join(lines)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
