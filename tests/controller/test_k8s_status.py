"""The pure mapping from a run's Job and pods to an Observation, as a table (the cases the fake API
server's Job controller does not produce on its own: Kueue suspension, image pull trouble, eviction,
a deadline without pod exits)."""

from __future__ import annotations

import pytest

from deepfleet.controller.backends.base import RunPhase
from deepfleet.controller.backends.kubernetes.names import COMPLETION_INDEX
from deepfleet.controller.backends.kubernetes.status import observation
from deepfleet.worker.spec import FailureClass


def pod(index: int, phase: str, *, state: dict | None = None, reason: str | None = None, created: str = "") -> dict:
    status: dict = {"phase": phase}
    if state is not None:
        status["containerStatuses"] = [{"name": "worker", "state": state}]
    if reason:
        status.update(reason=reason, message=f"The node was low on resource: memory. ({reason})")
    return {"metadata": {"name": f"p{index}", "labels": {COMPLETION_INDEX: str(index)}, "creationTimestamp": created},
            "status": status}


def job(*conditions: tuple[str, str], suspend: bool = False) -> dict:
    return {"spec": {"completions": 2, "suspend": suspend},
            "status": {"conditions": [{"type": t, "status": "True", "reason": r, "message": "m"} for t, r in conditions]}}


def exited(code: int, reason: str = "Error", finished: str = "2026-01-01T00:00:00Z") -> dict:
    return {"terminated": {"exitCode": code, "reason": reason, "finishedAt": finished}}


RUNNING = {"running": {}}


@pytest.mark.parametrize(("the_job", "pods", "phase", "fc", "message"), [
    (None, [], RunPhase.NOT_FOUND, None, "no such Job"),
    (job(suspend=True), [], RunPhase.PENDING, None, "suspended: waiting for queue admission"),
    (job(), [pod(0, "Pending", state={"waiting": {"reason": "ImagePullBackOff"}}), pod(1, "Running", state=RUNNING)],
     RunPhase.PENDING, None, "1/2 pods running; node 0: ImagePullBackOff"),
    (job(), [pod(0, "Running", state=RUNNING), pod(1, "Running", state=RUNNING)], RunPhase.RUNNING, None, "2/2"),
    (job(), [pod(0, "Failed", reason="Evicted"), pod(1, "Running", state=RUNNING)], RunPhase.FAILED,
     FailureClass.NODE_LOST, "node 0: Evicted"),
    (job(("Failed", "DeadlineExceeded")), [], RunPhase.FAILED, FailureClass.NODE_LOST, "Job failed: DeadlineExceeded"),
    (job(("Failed", "BackoffLimitExceeded")), [], RunPhase.FAILED, FailureClass.UNKNOWN, "Job failed: BackoffLimitExceeded"),
    # The earliest failure decides: node 1 ran out of memory first, node 0 then lost its peer.
    (job(("Failed", "BackoffLimitExceeded")),
     [pod(0, "Failed", state=exited(76, finished="2026-01-01T00:00:09Z")),
      pod(1, "Failed", state=exited(137, "OOMKilled", finished="2026-01-01T00:00:05Z"))],
     RunPhase.FAILED, FailureClass.OOM, "node 1 exited 137 (OOMKilled) [oom]"),
    (job(("SuccessCriteriaMet", ""), ("Complete", "")),
     [pod(0, "Succeeded", state=exited(0, "Completed")), pod(1, "Succeeded", state=exited(0, "Completed"))],
     RunPhase.SUCCEEDED, FailureClass.SUCCEEDED, ""),
])
def test_observation_table(the_job, pods, phase, fc, message) -> None:
    obs = observation(the_job, pods, nodes=2)
    assert (obs.phase, obs.failure_class) == (phase, fc)
    assert obs.message.startswith(message), obs.message


def test_the_log_tail_is_read_for_the_failed_pod_only() -> None:
    asked = []

    def tail(p: dict) -> str:
        asked.append(p["metadata"]["name"])
        return "RuntimeError: NCCL error: unhandled system error"

    obs = observation(job(), [pod(0, "Running", state=RUNNING), pod(1, "Failed", state=exited(1))], nodes=2, log_tail=tail)
    assert obs.failure_class is FailureClass.COMM_FAILURE and asked == ["p1"] and obs.exit_codes == {1: 1}
