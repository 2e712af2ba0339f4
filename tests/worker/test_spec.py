"""WorkerSpec loading and validation, the exit-code contract and its classifier (tables), and the
Heartbeat/FailureReport bodies."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from deepfleet.worker.spec import (
    ExitCode,
    FactoryEntrypoint,
    FailureClass,
    FailureReport,
    Heartbeat,
    ScriptEntrypoint,
    WorkerSpecError,
    classify_exit,
    load_worker_spec,
    parse_worker_spec,
    signal_exit_code,
)

SCRIPT = {"job_id": "j1", "entrypoint": {"script": "train.py", "args": ["--steps", "3"]}}
FACTORY = {"job_id": "j1", "entrypoint": {"factory": "examples.gpt.factories:build"}, "max_steps": 5}


def test_script_and_factory_entrypoints_are_told_apart_by_key() -> None:
    s = parse_worker_spec(SCRIPT, environ={})
    assert isinstance(s.entrypoint, ScriptEntrypoint) and s.entrypoint.args == ["--steps", "3"]
    f = parse_worker_spec(FACTORY, environ={})
    assert isinstance(f.entrypoint, FactoryEntrypoint) and f.entrypoint.args == {}
    assert (s.nodes.min, s.nodes.max, s.processes_per_node, s.rendezvous.backend) == (1, 1, 1, "c10d")
    assert s.run_id == "j1-0"


@pytest.mark.parametrize(
    ("patch", "expected"),
    [
        ({"entrypoint": {"script": "a.py", "argz": []}}, "entrypoint.argz: unknown key"),
        ({"entrypoint": {"nothing": 1}}, 'entrypoint: give either {script: path'),
        ({"entrypoint": {"factory": "nocolon"}, "max_steps": 1}, "entrypoint.factory: 'nocolon' is not"),
        ({"entrypoint": {"factory": "a.b:c"}}, "max_steps: a factory entrypoint needs it"),
        ({"nodes": {"min": 3, "max": 2}}, "nodes: min (3) is greater than max (2)"),
        ({"nodes": {"min": 0}}, "nodes.min: Input should be greater than or equal to 1"),
        ({"rendezvous": {"endpoint": "nohost"}}, "rendezvous.endpoint: 'nohost' is not \"host:port\""),
        ({"rendezvous": {"backend": "etcd"}}, "rendezvous.backend: Input should be 'c10d'"),
        ({"checkpoint": {"keep_last": 0}}, "checkpoint.keep_last: Input should be greater than or equal to 1"),
        ({"heartbeat": {"url": "ftp://x"}}, "heartbeat.url: 'ftp://x' is not an http(s) URL"),
        ({"env": {"1BAD": "x"}}, "env: invalid variable name(s) ['1BAD']"),
        ({"bogus": True}, "bogus: unknown key; remove it"),
    ],
)
def test_invalid_specs_name_the_field(patch: dict, expected: str) -> None:
    with pytest.raises(WorkerSpecError) as e:
        parse_worker_spec({**SCRIPT, **patch}, environ={})
    assert any(line.startswith(expected) for line in e.value.errors), e.value.errors
    assert all("\n" not in line and ": " in line for line in e.value.errors)


def test_missing_job_id_is_filled_from_the_worker_environment() -> None:
    env = {"DEEPFLEET_JOB_ID": "env-job", "DEEPFLEET_ATTEMPT": "2", "DEEPFLEET_HEARTBEAT_URL": "http://c/hb",
           "DEEPFLEET_TOKEN": "secret"}
    spec = parse_worker_spec({"entrypoint": {"script": "a.py"}}, environ=env)
    assert (spec.job_id, spec.attempt, spec.run_id) == ("env-job", 2, "env-job-2")
    assert (spec.heartbeat.url, spec.heartbeat.token) == ("http://c/hb", "secret")
    # values in the spec win over the environment
    spec = parse_worker_spec({**SCRIPT, "attempt": 1}, environ=env)
    assert (spec.job_id, spec.attempt) == ("j1", 1)
    with pytest.raises(WorkerSpecError, match="job_id: required"):
        parse_worker_spec({"entrypoint": {"script": "a.py"}}, environ={})


def test_load_from_json_text_path_yaml_and_env(tmp_path: Path) -> None:
    assert load_worker_spec(json.dumps(SCRIPT), environ={}).job_id == "j1"
    p = tmp_path / "spec.json"
    p.write_text(json.dumps(FACTORY))
    assert load_worker_spec(p, environ={}).max_steps == 5
    y = tmp_path / "spec.yaml"
    y.write_text("job_id: y\nentrypoint:\n  script: t.py\n")
    assert load_worker_spec(y, environ={}).job_id == "y"
    assert load_worker_spec(environ={"DEEPFLEET_WORKER_SPEC": str(p)}).job_id == "j1"
    assert load_worker_spec(environ={"DEEPFLEET_WORKER_SPEC": json.dumps(SCRIPT)}).job_id == "j1"


@pytest.mark.parametrize(
    ("source", "env", "expected"),
    [
        (None, {}, "<spec>: none given"),
        ("{not json", {}, "<spec>: not valid JSON"),
        (None, {"DEEPFLEET_WORKER_SPEC": "{bad"}, "DEEPFLEET_WORKER_SPEC: not valid JSON"),
        ("/no/such/spec.json", {}, "<spec>: file '/no/such/spec.json' does not exist"),
        ("[1, 2]", {}, "<spec>: file"),
    ],
)
def test_load_errors_are_one_line(source: str | None, env: dict, expected: str) -> None:
    with pytest.raises(WorkerSpecError) as e:
        load_worker_spec(source, environ=env)
    assert e.value.errors[0].startswith(expected), e.value.errors


def test_exit_codes_match_the_design_contract() -> None:
    assert {c.name: int(c) for c in ExitCode} == {
        "SUCCEEDED": 0, "INVALID_SPEC": 64, "USER_ERROR": 65, "PREEMPTED": 75, "COMM_FAILURE": 76, "OOM": 77,
    }
    assert signal_exit_code(signal.SIGKILL) == 137 and signal_exit_code(signal.SIGTERM) == 143


CLASSIFY = [
    # (code, log tail, class)
    (0, "", FailureClass.SUCCEEDED),
    (64, "", FailureClass.INVALID_SPEC),
    (65, "ValueError: bad shape", FailureClass.USER_ERROR),
    (75, "", FailureClass.PREEMPTED),
    (76, "", FailureClass.COMM_FAILURE),
    (77, "", FailureClass.OOM),
    (75, "CUDA out of memory", FailureClass.PREEMPTED),  # the worker's own code is trusted
    (1, "Traceback ...\nKeyError: 'x'", FailureClass.USER_ERROR),
    (1, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", FailureClass.OOM),
    (65, "RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory",
     FailureClass.OOM),
    (1, "MemoryError", FailureClass.OOM),
    (1, "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error",
     FailureClass.COMM_FAILURE),
    (1, "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE)",
     FailureClass.COMM_FAILURE),
    (1, "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer",
     FailureClass.COMM_FAILURE),
    (1, "RuntimeError: Gloo connectFullMesh failed with ... timed out connecting", FailureClass.COMM_FAILURE),
    (1, "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError", FailureClass.COMM_FAILURE),
    (1, "torch.distributed.DistNetworkError: failed to recv, got 0 bytes", FailureClass.COMM_FAILURE),
    (137, "", FailureClass.NODE_LOST),
    (137, "Memory cgroup out of memory: Killed process 4242 (python)", FailureClass.OOM),
    (143, "", FailureClass.NODE_LOST),
    (-9, "", FailureClass.NODE_LOST),
    (-9, "OOMKilled", FailureClass.OOM),
    (128, "", FailureClass.UNKNOWN),
]


@pytest.mark.parametrize(("code", "log", "expected"), CLASSIFY)
def test_classify_exit(code: int, log: str, expected: FailureClass) -> None:
    assert classify_exit(code, log_tail=log) is expected


def test_report_bodies_round_trip_as_json() -> None:
    hb = Heartbeat(step=7, loss=1.5, lr=1e-3, grad_norm=0.3, tokens_per_s=1234.0,
                   last_complete_checkpoint="global_step5")
    back = Heartbeat.model_validate_json(hb.model_dump_json())
    assert back == hb and back.time.tzinfo is not None
    fr = FailureReport(rank=1, failure_class=FailureClass.OOM, message="CUDA out of memory")
    body = json.loads(fr.model_dump_json())
    assert body == {"rank": 1, "class": "oom", "message": "CUDA out of memory"}
    assert FailureReport.model_validate(body) == fr
    with pytest.raises(ValueError, match="extra"):
        Heartbeat.model_validate({"step": 1, "speed": 2})
