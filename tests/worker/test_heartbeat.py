"""worker/heartbeat.py against a real HTTP server on 127.0.0.1: bodies and bearer token arrive; a slow
or dead endpoint never blocks `submit()`, the queue drops the oldest beats, and failures are counted
and logged once per interval."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest

from deepfleet.worker.heartbeat import HeartbeatReporter
from deepfleet.worker.spec import FailureClass, FailureReport, Heartbeat, HeartbeatSpec
from tests.spawn import free_port
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
    url = f"http://127.0.0.1:{free_port()}/hb"  # nothing listens there
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
