"""worker/heartbeat.py against a real HTTP server on 127.0.0.1: bodies and bearer token arrive; a slow
or dead endpoint never blocks `submit()`, the queue drops the oldest beats, and failures are counted
and logged once per interval."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator

import pytest

from deepfleet.worker.heartbeat import HeartbeatReporter
from deepfleet.worker.spec import FailureClass, FailureReport, Heartbeat, HeartbeatSpec
from tests.worker.http_sink import Sink, running_sink


@pytest.fixture
def controller() -> Iterator[Sink]:
    with running_sink() as srv:
        yield srv


def _url(srv: Sink, path: str) -> str:
    return srv.url(path)


def test_heartbeats_arrive_with_bearer_token(controller: Sink) -> None:
    spec = HeartbeatSpec(url=_url(controller, "/jobs/j1/heartbeat"), failure_url=_url(controller, "/jobs/j1/failure"),
                         token="tok", interval_s=5)
    now = [100.0]
    hb = HeartbeatReporter(spec, clock=lambda: now[0]).start()
    assert hb.due()
    hb.submit(Heartbeat(step=1, loss=2.5, lr=1e-3, tokens_per_s=10.0, last_complete_checkpoint=None))
    assert not hb.due()  # the next one is due interval_s later (injected clock)
    now[0] += 5
    assert hb.due()
    hb.submit(Heartbeat(step=2, loss=2.0, last_complete_checkpoint="global_step2"))
    hb.close(flush_s=5)
    assert [(p, a, b["step"]) for p, a, b in controller.received] == [
        ("/jobs/j1/heartbeat", "Bearer tok", 1), ("/jobs/j1/heartbeat", "Bearer tok", 2)]
    assert Heartbeat.model_validate(controller.received[1][2]).last_complete_checkpoint == "global_step2"
    assert hb.report_failure(FailureReport(rank=1, failure_class=FailureClass.OOM, message="out of memory"))
    assert controller.received[-1] == ("/jobs/j1/failure", "Bearer tok", {"rank": 1, "class": "oom",
                                                                          "message": "out of memory"})
    assert (hb.sent, hb.failed, hb.dropped) == (2, 0, 0)


def test_slow_endpoint_never_blocks_and_drops_the_oldest(controller: Sink) -> None:
    controller.delay_s = 30.0  # the first post hangs until released
    hb = HeartbeatReporter(HeartbeatSpec(url=_url(controller, "/hb"), timeout_s=10), max_queue=3).start()
    hb.submit(Heartbeat(step=0))
    assert controller.arrived.wait(10)  # the first beat is in flight and hangs
    start = time.monotonic()
    for step in range(1, 50):
        hb.submit(Heartbeat(step=step))
    assert time.monotonic() - start < 0.5  # 49 submits while the endpoint hangs
    controller.release.set()
    hb.close(flush_s=5)
    steps = [b["step"] for _, _, b in controller.received]
    # the first beat was in flight; of the rest only the newest three survived the bounded queue
    assert steps[0] == 0 and steps[-3:] == [47, 48, 49] and len(steps) == 4
    assert hb.dropped == 46


def test_dead_endpoint_is_counted_and_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as bound:  # bound and held, never listening: connections are refused
        bound.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound.getsockname()[1]}/hb"
        hb = HeartbeatReporter(HeartbeatSpec(url=url, interval_s=3600, timeout_s=0.5)).start()
        with caplog.at_level(logging.WARNING, logger="deepfleet.worker.heartbeat"):
            for step in range(5):
                hb.submit(Heartbeat(step=step))
                time.sleep(0.05)
            hb.close(flush_s=5)
    assert hb.sent == 0 and hb.failed + hb.dropped == 5 and hb.failed >= 1
    assert len([r for r in caplog.records if "heartbeat to" in r.message]) == 1
    assert not hb.report_failure(FailureReport(rank=0, failure_class=FailureClass.USER_ERROR, message="x"))


def test_disabled_reporter_is_a_no_op() -> None:
    hb = HeartbeatReporter(HeartbeatSpec()).start()
    assert not hb.enabled and not hb.due()
    hb.submit(Heartbeat(step=1))
    hb.close()
    assert (hb.sent, hb.failed, hb.dropped) == (0, 0, 0)


def _metrics(step: int, **over: object):
    from deepfleet.engine.metrics import StepMetrics

    fields = dict(step=step, rank=0, loss=1.0 / step, lr=1e-3, lrs=(1e-3,), grad_norm=0.5, loss_scale=1.0,
                  skipped=False, skipped_steps=0, samples=8, global_samples=8 * step, tokens=100, elapsed_s=0.5)
    return StepMetrics(**{**fields, **over})


def test_heartbeat_sink_reads_step_metrics_and_averages_tokens_per_second(controller: Sink) -> None:
    from deepfleet.worker.heartbeat import HeartbeatSink

    now = [0.0]
    spec = HeartbeatSpec(url=controller.url("/hb"), interval_s=10)
    sink = HeartbeatSink(HeartbeatReporter(spec, clock=lambda: now[0]).start(), last_checkpoint=lambda: "global_step2")
    sink(_metrics(1))  # due at once
    sink(_metrics(2))
    now[0] = 10.0
    sink(_metrics(3, grad_norm=float("inf"), tokens=300, elapsed_s=1.0, mfu=0.37, dp_epsilon=1.25, dp_delta=1e-5,
                  timings={"forward": 0.1, "checkpoint": 2.5}))  # due: covers steps 2 and 3
    sink.reporter.close(flush_s=5)
    beats = controller.bodies("/hb")
    assert [b["step"] for b in beats] == [1, 3]
    assert beats[0]["tokens_per_s"] == 200.0 and beats[1]["tokens_per_s"] == pytest.approx(400 / 1.5)
    assert beats[1]["loss"] == pytest.approx(1 / 3) and beats[1]["lr"] == 1e-3
    assert beats[1]["grad_norm"] is None  # an overflowed step's inf norm is not sent
    assert beats[1]["last_complete_checkpoint"] == "global_step2"
    assert beats[0]["mfu"] is None and beats[1]["mfu"] == 0.37  # MFU from the engine's FLOPs profiler
    assert beats[0]["checkpoint_s"] == 0.0 and beats[1]["checkpoint_s"] == 2.5  # save_checkpoint seconds
    assert beats[0]["dp_epsilon"] is None and (beats[1]["dp_epsilon"], beats[1]["dp_delta"]) == (1.25, 1e-5)  # DP-SGD


def test_step_sink_factory_opts_out_without_an_endpoint_or_off_rank_0() -> None:
    from deepfleet.worker.heartbeat import step_sink

    assert step_sink({}) is None
    assert step_sink({"DEEPFLEET_HEARTBEAT_URL": "http://127.0.0.1:1/hb", "RANK": "1"}) is None
    managed = {"job_id": "m", "entrypoint": {"factory": "pkg.mod:build"}, "max_steps": 2,
               "heartbeat": {"url": "http://127.0.0.1:1/hb"}}
    assert step_sink({"DEEPFLEET_WORKER_SPEC": json.dumps(managed)}) is None  # train.py posts its own


@pytest.mark.slow
def test_a_plain_script_posts_heartbeats_through_the_step_sink_factory(controller: Sink, tmp_path) -> None:
    """A DeepSpeed-style script that knows nothing of the worker, launched with the environment the
    worker gives script jobs, posts heartbeats from the engine's step seam."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "engine" / "plain_script.py"
    spec = {"job_id": "script", "entrypoint": {"script": str(script)},
            "heartbeat": {"url": controller.url("/jobs/script/heartbeat"), "interval_s": 0.01},
            "checkpoint": {"dir": str(tmp_path)}}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DEEPFLEET_WORKER_SPEC": json.dumps(spec),
           "DEEPFLEET_TOKEN": "s3cret", "DEEPFLEET_STEP_SINKS": "deepfleet.worker.heartbeat:step_sink"}
    subprocess.run([sys.executable, str(script), "5"], env=env, timeout=120, check=True, capture_output=True)
    beats = controller.bodies("/jobs/script/heartbeat")
    assert {a for _, a, _ in controller.received} == {"Bearer s3cret"}
    steps = [b["step"] for b in beats]
    assert steps[0] == 1 and steps[-1] == 5 and steps == sorted(steps), steps
    assert all(b["loss"] > 0 and b["lr"] == 1e-2 and b["grad_norm"] > 0 for b in beats)
    assert beats[0]["tokens_per_s"] > 0  # 4 x 6 token ids per micro-batch
