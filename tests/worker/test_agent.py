"""worker/agent.py: the exit-code mapping (tables), the launch configuration, and end to end under
torch's elastic agent with a tiny plain-torch script (tests/worker/elastic_script.py): a rank killed
with SIGKILL is restarted and training ends bit-equal to an uninterrupted run; a user error, an OOM
and SIGTERM become exit codes 65, 77 and 75."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from deepfleet.worker.agent import (
    child_environment,
    exit_code_for_exception,
    exit_code_for_failures,
    launch_config,
)
from deepfleet.worker.rendezvous import resolve
from deepfleet.worker.spec import WorkerSpecError, parse_worker_spec
from tests.worker.run_worker import WORKER, run_worker

SCRIPT = Path(__file__).with_name("elastic_script.py")


@pytest.mark.parametrize(
    ("codes", "expected"),
    [
        ([0, 0], 0),
        ([75, 75], 75),
        ([65, -15], 65),  # one rank raised, the agent then SIGTERMed its peer
        ([76, 65], 65),  # the peer's comm timeout is a consequence of the user error
        ([-9, 76], 137),  # a killed rank is the root cause of its peer's broken collective
        ([77, 76, 65], 77),
        ([64, 77], 64),
        ([1, 0], 65),  # a non-contract status is a user error
        ([3, -6], 65),  # the script exited 3; its peer then aborted in a broken collective (SIGABRT)
        ([75, 76], 76),  # preemption counts only when every failed rank stopped resumably
    ],
)
def test_exit_code_for_failures(codes: list[int], expected: int) -> None:
    assert exit_code_for_failures(codes) == expected


def test_exit_code_for_exception() -> None:
    import torch.distributed as dist

    assert exit_code_for_exception(ValueError("bad")) == 65
    assert exit_code_for_exception(MemoryError()) == 77
    assert exit_code_for_exception(RuntimeError("CUDA out of memory. Tried to allocate 1 GiB")) == 77
    assert exit_code_for_exception(dist.DistNetworkError("recv failed")) == 76
    assert exit_code_for_exception(RuntimeError("gloo/transport/tcp/pair.cc:534] Connection closed by peer")) == 76
    assert exit_code_for_exception(WorkerSpecError(["x: bad; fix"])) == 64


def _spec(tmp_path: Path, args: list[str], **over: object) -> dict:
    data = {
        "job_id": "e2e",
        "entrypoint": {"script": str(SCRIPT), "args": ["--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path),
                                                       *args]},
        "processes_per_node": 2,
        "rendezvous": {"port": 0, "last_call_timeout_s": 2, "join_timeout_s": 60},
        "restart": {"max_restarts": 0}, "monitor_interval_s": 0.2,
        "preemption": {"grace_period_s": 20},
    }
    data.update(over)
    return data


def test_launch_config_and_child_environment(tmp_path: Path) -> None:
    spec = parse_worker_spec(_spec(tmp_path, [], nodes={"min": 1, "max": 2}, env={"FOO": "bar"},
                                   heartbeat={"url": "http://c/hb", "token": "s3cret"},
                                   preemption={"notice_file": "/tmp/notice", "grace_period_s": 12.5}),
                             environ={})
    rdzv = resolve(spec, {"DEEPFLEET_NNODES": "2", "DEEPFLEET_NODE_RANK": "1", "DEEPFLEET_MASTER_ADDR": "h0",
                          "DEEPFLEET_MASTER_PORT": "29511"})
    cfg = launch_config(spec, rdzv)
    assert (cfg.min_nodes, cfg.max_nodes, cfg.nproc_per_node, cfg.rdzv_backend) == (1, 2, 2, "c10d")
    assert cfg.rdzv_endpoint == "h0:29511" and cfg.run_id == "e2e-0"
    assert cfg.rdzv_configs.items() >= {"join_timeout": 60, "last_call_timeout": 2, "close_timeout": 60,
                                        "is_host": False, "keep_alive_interval": 5,
                                        "keep_alive_max_attempt": 3}.items()
    assert (cfg.max_restarts, cfg.shutdown_timeout) == (0, 13)
    env = child_environment(spec, marker=tmp_path / "m", final=tmp_path / "f", cpu=True)
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert env["FOO"] == "bar" and env["DEEPFLEET_PREEMPTED_MARKER"] == str(tmp_path / "m")
    # the worker watches the notice file; training processes must not stop on their own
    child = json.loads(env["DEEPFLEET_WORKER_SPEC"])
    assert child["preemption"]["notice_file"] is None
    # the token reaches the training processes through DEEPFLEET_TOKEN, not inside the spec text
    assert "s3cret" not in env["DEEPFLEET_WORKER_SPEC"] and env["DEEPFLEET_TOKEN"] == "s3cret"
    assert parse_worker_spec(child, environ=env).heartbeat.token == "s3cret"


def _run_worker(spec: dict, *, timeout: float = 150, on_line=None, extra_env: dict | None = None) -> tuple[int, str]:
    return run_worker(spec, timeout=timeout, wait_s=30, on_line=on_line, extra_env=extra_env)


def _steps(log: str) -> list[tuple[int, int, int, float]]:
    return [(int(s), int(r), int(k), float(t)) for s, r, k, t in
            re.findall(r"STEP (\d+) rank=(\d+) restart=(\d+) t=([\d.]+)", log)]


@pytest.mark.e2e
@pytest.mark.slow
def test_sigkilled_rank_is_restarted_and_resumes_bit_exact(tmp_path: Path) -> None:
    ref_dir, crash_dir = tmp_path / "ref", tmp_path / "crash"
    ref_dir.mkdir()
    crash_dir.mkdir()
    code, log = _run_worker(_spec(ref_dir, ["--steps", "5"]))
    assert code == 0, log
    crash = _spec(crash_dir, ["--steps", "5", "--fail-rank", "1", "--fail-step", "3", "--fail-how", "kill"],
                  restart={"max_restarts": 2})
    code, log = _run_worker(crash)
    assert code == 0, log
    assert "RESUMED step=2 rank=1 restart=1" in log
    ref = json.loads((ref_dir / "final.json").read_text())
    got = json.loads((crash_dir / "final.json").read_text())
    assert got["sha"] == ref["sha"], (got, ref)
    killed_at = float(re.search(r"KILL rank=1 step=3 t=([\d.]+)", log).group(1))
    first_after = min(t for s, _, k, t in _steps(log) if k == 1)
    print(json.dumps({"metric": "sigkill_to_first_step_s", "value": round(first_after - killed_at, 2)}))


@pytest.mark.e2e
@pytest.mark.parametrize(("how", "expected"), [("raise", 65), ("oom", 77), ("exit3", 65)])
@pytest.mark.slow
def test_training_failures_map_to_exit_codes(tmp_path: Path, how: str, expected: int) -> None:
    code, log = _run_worker(_spec(tmp_path, ["--steps", "3", "--fail-rank", "0", "--fail-step", "2",
                                             "--fail-how", how]))
    assert code == expected, log


@pytest.mark.e2e
@pytest.mark.slow
def test_sigterm_stops_at_a_step_boundary_with_exit_75_and_resumes(tmp_path: Path) -> None:
    sent: list[float] = []

    def terminate_after_step_2(proc: subprocess.Popen, line: str) -> None:
        if not sent and line.startswith("STEP 2 "):
            sent.append(time.monotonic())
            proc.send_signal(signal.SIGTERM)  # the worker only, as Kubernetes signals PID 1

    spec = _spec(tmp_path, ["--steps", "40", "--step-sleep", "0.3"])
    code, log = _run_worker(spec, on_line=terminate_after_step_2)
    assert code == 75, log
    stopped = max(s for s, *_ in _steps(log))
    assert stopped < 40 and "preempted; checkpoint step" in log
    assert (tmp_path / "ckpt" / "latest").read_text() == f"step{stopped}"
    # the next attempt resumes from that checkpoint: no step is lost or repeated
    spec["entrypoint"]["args"] = ["--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path), "--steps",
                                  str(stopped + 2)]
    code, log = _run_worker(spec)
    assert code == 0, log
    assert f"RESUMED step={stopped}" in log and sorted({s for s, *_ in _steps(log)}) == [stopped + 1, stopped + 2]


@pytest.mark.e2e
@pytest.mark.slow
def test_notice_file_preempts_with_exit_75(tmp_path: Path) -> None:
    notice = tmp_path / "notice"

    def notice_after_step_1(proc: subprocess.Popen, line: str) -> None:
        if line.startswith("STEP 1 "):
            notice.write_text("spot eviction")

    spec = _spec(tmp_path, ["--steps", "40", "--step-sleep", "0.3"],
                 preemption={"notice_file": str(notice), "grace_period_s": 20})
    code, log = _run_worker(spec, on_line=notice_after_step_1)
    assert code == 75, log
    assert max(s for s, *_ in _steps(log)) < 40


def test_invalid_spec_is_one_line_and_exit_64() -> None:
    proc = subprocess.run([*WORKER, "--spec", '{"job_id": "x", "entrypoint": {"script": "t.py"}, "nodes": {"min": 0}}'],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 64
    assert proc.stderr.strip().splitlines() == [
        "deepfleet-worker: invalid spec: nodes.min: Input should be greater than or equal to 1; fix the value"]
    assert "Traceback" not in proc.stderr


def test_missing_script_is_an_invalid_spec_and_never_restarted_in_place(tmp_path: Path) -> None:
    spec = _spec(tmp_path, [], restart={"max_restarts": 3, "in_place_restarts": 3})
    spec["entrypoint"]["script"] = str(tmp_path / "nope.py")
    spec["processes_per_node"] = 1
    code, log = _run_worker(spec)
    assert code == 64, log
    # one process, one failure: the elastic agent did not re-run an invalid spec
    assert log.count("deepfleet-worker: invalid spec: entrypoint.script:") == 1, log
    assert "the restart policy does not retry it" in log


def test_in_place_restarts_are_capped_by_max_restarts(tmp_path: Path) -> None:
    rdzv = {"DEEPFLEET_NNODES": "1", "DEEPFLEET_NODE_RANK": "0", "DEEPFLEET_MASTER_ADDR": "h0"}
    for policy, expected in [({"max_restarts": 0}, 0), ({"max_restarts": 5, "in_place_restarts": 2}, 2),
                             ({"max_restarts": 1}, 1), ({}, 3)]:
        spec = parse_worker_spec(_spec(tmp_path, [], restart=policy), environ={})
        assert launch_config(spec, resolve(spec, rdzv)).max_restarts == expected, policy


@pytest.mark.e2e
@pytest.mark.slow
def test_a_user_error_is_not_restarted_in_place_unless_the_policy_retries_it(tmp_path: Path) -> None:
    # The fault fires once per run: an in-place restart would succeed, so exit 65 proves there was none.
    args = ["--steps", "3", "--fail-rank", "0", "--fail-step", "2"]
    code, log = _run_worker(_spec(tmp_path, args, restart={"max_restarts": 2}))
    assert code == 65 and log.count("simulated bug") >= 1 and "RESUMED" not in log, log
    code, log = _run_worker(_spec(tmp_path / "b", args, restart={"max_restarts": 2, "retry_on_user_error": True}))
    assert code == 0, log


@pytest.mark.e2e
@pytest.mark.slow
def test_sigterm_while_waiting_for_peers_exits_143(tmp_path: Path) -> None:
    """No training process has started (the rendezvous waits for a second node), so nothing can be
    checkpointed: the worker reports the signal, not a resumable preemption."""
    def terminate_once_started(proc: subprocess.Popen, line: str) -> None:
        if line.startswith("deepfleet-worker: job"):
            time.sleep(1.0)  # let it enter the rendezvous
            proc.send_signal(signal.SIGTERM)

    spec = _spec(tmp_path, [], nodes={"min": 2, "max": 2})
    start = time.monotonic()
    code, log = _run_worker(spec, on_line=terminate_once_started, timeout=60,
                            extra_env={"DEEPFLEET_RDZV_PORT_FILE": str(tmp_path / "rdzv-port")})
    assert code == 143, log
    assert time.monotonic() - start < 30


def test_a_script_receives_the_jobs_engine_config_checkpoint_dir_step_budget_and_heartbeat_sink(
        tmp_path: Path) -> None:
    from deepfleet.engine import job_env

    spec = parse_worker_spec(_spec(tmp_path, [], engine_config={"train_micro_batch_size_per_gpu": 2},
                                   checkpoint={"dir": "/ck", "every_steps": 5}, max_steps=7,
                                   heartbeat={"url": "http://c/hb"}), environ={})
    env = child_environment(spec, marker=tmp_path / "m", final=tmp_path / "f", cpu=True)
    assert json.loads(job_env.engine_config(env)) == {"train_micro_batch_size_per_gpu": 2}
    assert (job_env.checkpoint_dir(env), job_env.checkpoint_every_steps(env), job_env.max_steps(env)) == ("/ck", 5, 7)
    assert env["DEEPFLEET_STEP_SINKS"] == "deepfleet.worker.heartbeat:step_sink"
    # a path stays a path (the engine's reader opens it); the managed loop posts its own heartbeats
    managed = parse_worker_spec({**_spec(tmp_path, []), "entrypoint": {"factory": "a.b:c"}, "max_steps": 3,
                                 "engine_config": "/cfg/ds.yaml", "heartbeat": {"url": "http://c/hb"}}, environ={})
    env = child_environment(managed, marker=tmp_path / "m", final=tmp_path / "f", cpu=True)
    assert env["DEEPFLEET_ENGINE_CONFIG"] == "/cfg/ds.yaml" and "DEEPFLEET_STEP_SINKS" not in env
    assert "DEEPFLEET_CHECKPOINT_DIR" not in env
