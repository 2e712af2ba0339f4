"""Job specs and the fake-worker command shared by the controller runtime tests."""

from __future__ import annotations

import sys
from pathlib import Path

from deepfleet.controller.spec import JobSpec, validate_job

FAKE_WORKER = [sys.executable, str(Path(__file__).with_name("fake_worker.py"))]


def job_document(name: str = "fake", *, args: list[str] | None = None, nodes: int = 2, ckpt: Path | None = None,
                 max_restarts: int = 3, backoff: float = 0.0, priority: str = "normal", queue: str = "default") -> dict:
    spec: dict = {
        "backend": "local",
        "nodes": nodes,
        "processesPerNode": 1,
        "entrypoint": {"script": "fake_worker.py", "args": list(args or [])},
        "restartPolicy": {"maxRestarts": max_restarts, "backoffSeconds": backoff},
        "priority": priority,
        "queue": queue,
    }
    if ckpt is not None:
        spec["checkpoint"] = {"dir": str(ckpt), "everySteps": 2}
    return {"apiVersion": "deepfleet/v1", "kind": "TrainingJob",
            "metadata": {"name": name, "project": "test"}, "spec": spec}


def job_spec(name: str = "fake", **kw) -> JobSpec:
    return validate_job(job_document(name, **kw))
