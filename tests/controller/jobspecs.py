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


TINY_GPT_ARGS = {"vocab_size": 64, "seq_len": 16, "d_model": 32, "n_heads": 2, "n_layers": 1, "num_samples": 256}


def tiny_gpt_job(name: str, *, steps: int, engine: dict | None = None, **spec: object) -> dict:
    """A one-process managed-loop job on a very small example GPT (examples/gpt; the controller's
    workdir must be the repository root): the cheapest real-worker job."""
    return {"apiVersion": "deepfleet/v1", "kind": "TrainingJob", "metadata": {"name": name, "project": "test"},
            "spec": {"backend": "local", "nodes": 1, "processesPerNode": 1, "maxSteps": steps,
                     "entrypoint": {"factory": "examples.gpt.factories:build", "args": dict(TINY_GPT_ARGS)},
                     "engine": {"train_micro_batch_size_per_gpu": 4,
                                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **(engine or {})},
                     "restartPolicy": {"maxRestarts": 0}, **spec}}
