"""Job specs and the fake-worker command shared by the controller runtime tests."""

from __future__ import annotations

import sys
from pathlib import Path

from deepfleet.controller.spec import JobSpec, validate_job

FAKE_WORKER = [sys.executable, str(Path(__file__).with_name("fake_worker.py"))]


def job_document(name: str = "fake", *, args: list[str] | None = None, nodes: int = 2, ckpt: str | None = None,
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
    if ckpt is not None:  # a name inside the job's own checkpoint area
        spec["checkpoint"] = {"dir": ckpt, "everySteps": 2}
    return {"apiVersion": "deepfleet/v1", "kind": "TrainingJob",
            "metadata": {"name": name, "project": "test"}, "spec": spec}


def checkpoint_dir(data_dir: Path, job_id: str, name: str, *, project: str = "test") -> Path:
    """Where the local backend puts job `job_id`'s checkpoint dir `name` (`<jobs dir>/<project>/<id>/checkpoints`)."""
    return data_dir / "jobs" / project / job_id / "checkpoints" / name


def job_spec(name: str = "fake", **kw) -> JobSpec:
    return validate_job(job_document(name, **kw))
