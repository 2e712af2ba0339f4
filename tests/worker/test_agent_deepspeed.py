"""A job's script entrypoint with `deepspeed: true` runs an unmodified DeepSpeed script under the worker,
as `deepfleet run` does: `import deepspeed` is deepfleet's engine in the training processes, the script
gets `--local_rank`, and `deepspeed.initialize(args=...)` without `--deepspeed_config` takes the job's
engine config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.worker.run_worker import run_worker

SCRIPT = Path(__file__).resolve().parents[1] / "engine" / "compat" / "scripts" / "cifar_ds.py"


@pytest.mark.e2e
def test_script_job_runs_an_unmodified_deepspeed_script(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    spec = {
        "job_id": "ds-script",
        "entrypoint": {"script": str(SCRIPT), "args": ["--deepspeed", "--out", str(out)], "deepspeed": True},
        "engine_config": {"train_batch_size": 32, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                          "zero_optimization": {"stage": 2}},
        "processes_per_node": 2,
        "rendezvous": {"port": 0, "last_call_timeout_s": 2, "join_timeout_s": 60},
        "restart": {"max_restarts": 0}, "monitor_interval_s": 0.2,
    }
    code, log = run_worker(spec, timeout=150, wait_s=30)
    assert code == 0, log[-4000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["local_rank_arg"] == 0 and result["steps"] == 256 // 32
    assert len(result["losses"]) == 256 // 32  # micro-batch 16 per rank, one micro-step per step
    assert result["losses"][-1] < result["losses"][0]
