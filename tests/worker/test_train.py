"""worker/train.py, the managed loop, end to end under the worker (2 processes, ZeRO stage 2, the tiny
example GPT): heartbeats reach a real HTTP endpoint; a training process killed with SIGKILL mid-run is
restarted by the elastic agent and the run ends with exactly the weights of an uninterrupted run;
SIGTERM checkpoints at the next step boundary within the grace period and exits 75, and the next
attempt resumes from that checkpoint with no step lost; a failing factory exits 65 with a report."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.worker.http_sink import running_sink
from tests.worker.run_worker import run_worker

ROOT = Path(__file__).resolve().parents[2]
MAX_STEPS = 8
GPT = {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 16, "vocab_size": 64, "num_samples": 512}


def _spec(ckpt: Path, *, sleep_s: float = 0.0, every: int = 0, **over: object) -> dict:
    data = {
        "job_id": "managed",
        "entrypoint": {"factory": "tests.worker.managed_factories:slow_gpt", "args": {**GPT, "sleep_s": sleep_s}},
        "engine_config": str(ROOT / "examples/gpt/ds_config.json"),
        "max_steps": MAX_STEPS,
        "log_every_steps": 1,
        "checkpoint": {"dir": str(ckpt), "every_steps": every or None},
        "processes_per_node": 2,
        "rendezvous": {"port": 0, "last_call_timeout_s": 2, "join_timeout_s": 60},
        "restart": {"max_restarts": 0}, "monitor_interval_s": 0.2,
        "preemption": {"grace_period_s": 30},
    }
    data.update(over)
    return data


def _run(spec: dict, *, on_line=None, timeout: float = 240, extra_env: dict | None = None) -> tuple[int, str]:
    return run_worker(spec, timeout=timeout, wait_s=60, on_line=on_line, extra_env=extra_env)


def _weights(ckpt: Path, tag: str, tmp: Path) -> dict:
    from safetensors.torch import load_file

    from deepfleet.engine.checkpoint.export import export_safetensors

    out = tmp / f"{ckpt.parent.name}-{tag}.safetensors"
    export_safetensors(ckpt / tag, out)
    return load_file(str(out))


def _assert_same(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _training_pid(worker_pid: int, rank: int) -> int:
    """The training process of global rank `rank` among the worker's children (read from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == worker_pid and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    raise LookupError(f"no training process of rank {rank} under pid {worker_pid}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """An uninterrupted run; its heartbeats go to a real HTTP endpoint."""
    base = tmp_path_factory.mktemp("ref")
    with running_sink() as sink:
        spec = _spec(base / "ckpt", heartbeat={"url": sink.url("/hb"), "token": "t0k", "interval_s": 0.05},
                     checkpoint={"dir": str(base / "ckpt"), "every_steps": 2, "keep_last": 2})
        code, log = _run(spec)
        assert code == 0, log
        kept = sorted(p.name for p in (base / "ckpt").iterdir() if p.is_dir())
        assert kept == [f"global_step{MAX_STEPS - 2}", f"global_step{MAX_STEPS}"], kept  # keep_last
        beats = sink.bodies("/hb")
        auth = {a for _, a, _ in sink.received}
    return {"weights": _weights(base / "ckpt", f"global_step{MAX_STEPS}", base), "beats": beats, "auth": auth}


@pytest.mark.e2e
@pytest.mark.slow
def test_heartbeats_during_a_managed_run(reference: dict) -> None:
    beats = reference["beats"]
    assert reference["auth"] == {"Bearer t0k"}
    steps = [b["step"] for b in beats]
    assert steps == sorted(steps) and steps[-1] == MAX_STEPS and len(steps) >= 2
    assert beats[-1]["last_complete_checkpoint"] == f"global_step{MAX_STEPS}"
    first = beats[0]
    assert first["loss"] > 0 and first["lr"] is not None and first["tokens_per_s"] > 0 and first["grad_norm"] > 0


@pytest.mark.e2e
@pytest.mark.slow
def test_sigkilled_rank_restarts_and_matches_the_uninterrupted_run(reference: dict, tmp_path: Path) -> None:
    killed: list[float] = []

    def kill_rank1_after_step_3(proc: subprocess.Popen, line: str) -> None:
        if not killed and line.startswith("[deepfleet] step 3/"):
            os.kill(_training_pid(proc.pid, rank=1), signal.SIGKILL)  # mid-step: each forward sleeps 0.3 s
            killed.append(time.time())

    spec = _spec(tmp_path / "ckpt", sleep_s=0.3, every=1, restart={"max_restarts": 2})
    code, log = _run(spec, on_line=kill_rank1_after_step_3)
    assert code == 0 and killed, log
    resumed = re.search(r"restart 1: world size 2, starting at step (\d+)/\d+ from checkpoint global_step(\d+)", log)
    assert resumed and 3 <= int(resumed.group(1)) <= 5, log
    _assert_same(_weights(tmp_path / "ckpt", f"global_step{MAX_STEPS}", tmp_path), reference["weights"])
    first = min(float(t) for t in re.findall(r"step \d+/\d+ loss [\d.]+ restart 1 t=([\d.]+)", log))
    print(json.dumps({"metric": "managed_sigkill_to_first_step_s", "value": round(first - killed[0], 2)}))


@pytest.mark.e2e
@pytest.mark.slow
def test_sigterm_checkpoints_exits_75_and_resumes_without_losing_a_step(reference: dict, tmp_path: Path) -> None:
    sent: list[float] = []

    def terminate_after_step_2(proc: subprocess.Popen, line: str) -> None:
        if not sent and line.startswith("[deepfleet] step 2/"):
            proc.send_signal(signal.SIGTERM)  # the worker only, as Kubernetes signals PID 1
            sent.append(time.monotonic())

    ckpt = tmp_path / "ckpt"
    with running_sink() as sink:
        spec = _spec(ckpt, sleep_s=0.3, every=0,  # no periodic checkpoints: only the preemption one
                     heartbeat={"url": sink.url("/hb"), "interval_s": 3600})
        code, log = _run(spec, on_line=terminate_after_step_2)
        took = time.monotonic() - sent[0]
        beats = sink.bodies("/hb")
    assert code == 75, log
    assert took < spec["preemption"]["grace_period_s"], took
    stopped = re.search(r"checkpointing step (\d+)", log)
    assert stopped, log
    tag = f"global_step{stopped.group(1)}"
    assert 2 <= int(stopped.group(1)) < MAX_STEPS and (ckpt / tag / "COMPLETE").exists()
    assert (ckpt / "latest").read_text().strip() == tag and f"preempted; checkpoint {tag} is complete" in log
    # the controller hears of the checkpoint before the exit code (first beat at step 1, last at the stop)
    assert [b["step"] for b in beats] == [1, int(stopped.group(1))] and beats[-1]["last_complete_checkpoint"] == tag

    spec["attempt"] = 1
    code, log = _run(spec)
    assert code == 0, log
    assert f"starting at step {stopped.group(1)}/{MAX_STEPS} from checkpoint {tag}" in log
    _assert_same(_weights(ckpt, f"global_step{MAX_STEPS}", tmp_path), reference["weights"])


@pytest.mark.e2e
@pytest.mark.slow
def test_failing_factory_exits_65_and_reports(tmp_path: Path) -> None:
    with running_sink() as sink:
        spec = _spec(tmp_path / "ckpt", processes_per_node=1,
                     entrypoint={"factory": "tests.worker.managed_factories:broken"},
                     heartbeat={"url": sink.url("/hb"), "failure_url": sink.url("/fail"), "token": "x"})
        code, log = _run(spec)
        reports = sink.bodies("/fail")
    assert code == 65, log
    assert reports == [{"rank": 0, "class": "user_error",
                        "message": "KeyError: 'vocab_size missing from the tokenizer config'"}]


@pytest.mark.e2e
@pytest.mark.slow
def test_lost_node_shrinks_the_group_and_resumes_at_the_smaller_world_size(reference: dict, tmp_path: Path) -> None:
    """Two workers (nodes 1:2, one process each); node 1's worker is SIGKILLed with its training
    process (a node loss). Node 0's agent restarts, the rendezvous closes with one node, and training
    resumes at world size 1 from the checkpoint written at world size 2 (the config fixes the global
    batch: gradient accumulation doubles at world size 1)."""
    spec = _spec(tmp_path / "ckpt", sleep_s=0.3, every=1, processes_per_node=1, nodes={"min": 1, "max": 2},
                 rendezvous={"port": 0, "last_call_timeout_s": 2, "join_timeout_s": 60,
                             "keep_alive_interval_s": 1, "keep_alive_max_attempts": 2},
                 restart={"max_restarts": 2})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "DEEPFLEET_NNODES": "2",
           "DEEPFLEET_MASTER_ADDR": "127.0.0.1", "DEEPFLEET_RDZV_PORT_FILE": str(tmp_path / "rdzv-port")}
    node1 = subprocess.Popen([sys.executable, "-m", "deepfleet.worker.cli", "--spec", json.dumps(spec)], cwd=ROOT,
                             env={**env, "DEEPFLEET_NODE_RANK": "1"}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    killed: list[float] = []
    node1_lines: list[str] = []
    lock = threading.Lock()

    def lose_node1_after_step_3(proc: object, line: str) -> None:
        # global rank 0 (which logs) may live on either node: the rendezvous orders nodes by arrival
        with lock:
            if not killed and line.startswith("[deepfleet] step 3/"):
                node1.kill()  # its training process follows (parent-death signal)
                killed.append(time.time())

    def pump_node1() -> None:
        assert node1.stdout is not None
        for line in node1.stdout:
            node1_lines.append(line)
            lose_node1_after_step_3(node1, line)

    pump = threading.Thread(target=pump_node1, daemon=True)
    pump.start()

    try:
        code, log = _run(spec, on_line=lose_node1_after_step_3, extra_env={**env, "DEEPFLEET_NODE_RANK": "0"})
    finally:
        if node1.poll() is None:
            node1.kill()
        node1.wait()
        pump.join(timeout=10)
        if node1.stdout is not None:
            node1.stdout.close()
    assert code == 0 and killed, log
    assert "restart 0: world size 2, starting at step 0/" in log + "".join(node1_lines)
    resumed = re.search(r"restart 1: world size 1, starting at step (\d+)/\d+ from checkpoint global_step\d+", log)
    assert resumed and int(resumed.group(1)) >= 3, log
    manifest = json.loads((tmp_path / "ckpt" / f"global_step{MAX_STEPS}" / "manifest.json").read_text())
    assert manifest["world_size"] == 1
    assert _weights(tmp_path / "ckpt", f"global_step{MAX_STEPS}", tmp_path).keys() == reference["weights"].keys()
    first = min(float(t) for t in re.findall(r"step \d+/\d+ loss [\d.]+ restart 1 t=([\d.]+)", log))
    print(json.dumps({"metric": "node_loss_to_first_step_at_ws1_s", "value": round(first - killed[0], 2)}))


@pytest.mark.slow
def test_managed_loop_trains_a_pipeline(tmp_path: Path) -> None:
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "pipeline": {"stages": 2},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    spec = _spec(tmp_path / "ckpt", entrypoint={"factory": "tests.worker.managed_factories:pipeline_mlp",
                                                "args": {"num_stages": 2}},
                 engine_config=config, max_steps=3)
    code, out = _run(spec)
    assert code == 0, out
    assert "done at step 3, checkpoint global_step3" in out


@pytest.mark.e2e
def test_a_job_whose_config_enables_autotuning_tunes_on_its_ranks_then_trains(tmp_path: Path) -> None:
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "autotuning": {"enabled": True, "results_dir": str(tmp_path / "results"),
                             "exps_dir": str(tmp_path / "exps"), "start_profile_step": 1, "end_profile_step": 2,
                             "tuner_num_trials": 2, "num_tuning_micro_batch_sizes": 2,
                             "max_train_micro_batch_size_per_gpu": 4, "deepfleet_budget_gib": 1.0}}
    spec = _spec(tmp_path / "ckpt", engine_config=config, max_steps=3)
    code, out = _run(spec)
    assert code == 0, out
    winner = json.loads((tmp_path / "results" / "ds_config_optimal.json").read_text())
    summary = json.loads((tmp_path / "results" / "summary.json").read_text())
    assert len(summary["experiments"]) == 2 and all(e["metric"]["throughput"] > 0 for e in summary["experiments"])
    assert (f"autotuning: training with ZeRO stage {winner['zero_optimization']['stage']}, micro-batch "
            f"{winner['train_micro_batch_size_per_gpu']}") in out
    assert "done at step 3" in out
