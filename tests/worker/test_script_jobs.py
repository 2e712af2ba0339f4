"""Script jobs are first-class: through the real worker, a plain script gets the job's engine config,
step budget and checkpoint directory, and its steps reach the controller as heartbeats (the engine's
step seam, loaded from the DEEPFLEET_STEP_SINKS the worker sets) exactly as the managed loop's do."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.worker.http_sink import Sink, running_sink
from tests.worker.run_worker import run_worker

SCRIPT = Path(__file__).with_name("job_script.py")


@pytest.fixture
def controller() -> Iterator[Sink]:
    with running_sink() as sink:
        yield sink


@pytest.mark.e2e
@pytest.mark.slow
def test_a_script_jobs_heartbeats_arrive_through_the_real_worker(controller: Sink, tmp_path: Path) -> None:
    spec = {
        "job_id": "script", "entrypoint": {"script": str(SCRIPT)}, "processes_per_node": 1, "max_steps": 4,
        "engine_config": {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.05}}},
        "checkpoint": {"dir": str(tmp_path / "ck")},
        "heartbeat": {"url": controller.url("/jobs/script/heartbeat"), "token": "s3cret", "interval_s": 0.01},
        "rendezvous": {"port": 0, "last_call_timeout_s": 1, "join_timeout_s": 60},
        "restart": {"max_restarts": 0}, "monitor_interval_s": 0.2,
    }
    code, log = run_worker(spec, timeout=180, wait_s=30)
    assert code == 0, log
    assert f"SCRIPT DONE steps=4 checkpoint_dir={tmp_path / 'ck'}" in log  # the spec's budget and directory
    beats = controller.bodies("/jobs/script/heartbeat")
    steps = [b["step"] for b in beats]
    assert steps and steps[-1] == 4 and steps == sorted(steps), steps
    assert all(b["lr"] == 0.05 and b["loss"] > 0 for b in beats)  # the spec's engine config was used
    assert {a for _, a, _ in controller.received} == {"Bearer s3cret"}
