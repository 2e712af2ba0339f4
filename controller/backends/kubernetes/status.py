"""Map a run's Job and pods (raw API dicts) to an `Observation`: phase, per-node exit codes, failure class.

Called by `backend.KubernetesBackend.observe`; pure, so the mapping is tested as a table. The rules:

* no Job -> NOT_FOUND; a suspended Job (Kueue has not admitted it) -> PENDING;
* any pod that terminated non-zero, or a `Failed` / `FailureTarget` condition -> FAILED. The failure
  is the earliest-finishing failed pod, classified by `classify_exit(exit code, log_tail=...)` where
  the tail starts with the container's termination reason, so a kubelet `OOMKilled` (exit 137) reads
  as OOM while a bare 137 reads as node loss. A pod that failed without a container exit (evicted,
  node lost, deadline) is node loss;
* a `Complete` / `SuccessCriteriaMet` condition -> SUCCEEDED;
* every node's pod running -> RUNNING, else PENDING with what the pods wait on (image pulls, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deepfleet.controller.backends.base import Observation, RunPhase
from deepfleet.controller.backends.kubernetes.manifests import CONTAINER
from deepfleet.controller.backends.kubernetes.names import COMPLETION_INDEX
from deepfleet.worker.spec import FailureClass, classify_exit

_NODE_LOSS_REASONS = ("Evicted", "NodeLost", "Preempting", "DeadlineExceeded", "UnexpectedAdmissionError", "Shutdown")


def node_index(pod: dict[str, Any]) -> int | None:
    """The pod's completion index (its node rank), from the label or the annotation."""
    meta = pod.get("metadata", {})
    raw = meta.get("labels", {}).get(COMPLETION_INDEX) or meta.get("annotations", {}).get(COMPLETION_INDEX)
    return int(raw) if raw is not None and str(raw).isdigit() else None


def _container(pod: dict[str, Any]) -> dict[str, Any]:
    statuses = pod.get("status", {}).get("containerStatuses") or []
    return next((c for c in statuses if c.get("name") == CONTAINER), statuses[0] if statuses else {})


def terminated(pod: dict[str, Any]) -> dict[str, Any] | None:
    """The worker container's `state.terminated` (exitCode, reason, finishedAt), if it ended."""
    return (_container(pod).get("state") or {}).get("terminated")


def condition(job: dict[str, Any], *kinds: str) -> dict[str, Any] | None:
    for c in job.get("status", {}).get("conditions") or []:
        if c.get("type") in kinds and c.get("status") == "True":
            return c
    return None


def observation(job: dict[str, Any] | None, pods: list[dict[str, Any]], *, nodes: int,
                log_tail: Callable[[dict[str, Any]], str] = lambda pod: "") -> Observation:
    """The Observation of one run from its Job and pods; `log_tail(pod)` is asked only for the failed pod."""
    if job is None:
        return Observation(RunPhase.NOT_FOUND, message="no such Job")
    codes: dict[int, int] = {}
    failures: list[tuple[str, int, dict[str, Any]]] = []  # (finishedAt, index, pod)
    lost: list[tuple[int, dict[str, Any]]] = []
    running = 0
    waiting: list[str] = []
    for pod in sorted(pods, key=lambda p: p["metadata"].get("creationTimestamp") or ""):
        index = node_index(pod)
        if index is None:
            continue
        term = terminated(pod)
        phase = pod.get("status", {}).get("phase")
        if term is not None:
            codes[index] = int(term.get("exitCode", 0))
            if codes[index] != 0:
                failures.append((term.get("finishedAt") or "", index, pod))
        elif phase == "Failed":
            lost.append((index, pod))
        elif phase == "Running":
            running += 1
        else:
            reason = ((_container(pod).get("state") or {}).get("waiting") or {}).get("reason")
            if reason and reason not in ("ContainerCreating", "PodInitializing"):
                waiting.append(f"node {index}: {reason}")
    if failures:
        _, index, pod = min(failures, key=lambda f: (f[0], f[1]))
        term = terminated(pod) or {}
        reason = term.get("reason") or ""
        fc = classify_exit(codes[index], log_tail=f"{reason}\n{log_tail(pod)}")
        return Observation(RunPhase.FAILED, exit_codes=codes, failure_class=fc,
                           message=f"node {index} exited {codes[index]}" + (f" ({reason})" if reason else "")
                           + f" [{fc.value}]")
    if lost:
        index, pod = lost[0]
        why = pod.get("status", {}).get("reason") or "pod failed"
        return Observation(RunPhase.FAILED, exit_codes=codes, failure_class=FailureClass.NODE_LOST,
                           message=f"node {index}: {why}: {pod.get('status', {}).get('message', '')}".rstrip(": "))
    failed = condition(job, "Failed", "FailureTarget")
    if failed is not None:
        reason = failed.get("reason") or "Failed"
        fc = FailureClass.NODE_LOST if reason in _NODE_LOSS_REASONS else FailureClass.UNKNOWN
        return Observation(RunPhase.FAILED, exit_codes=codes, failure_class=fc,
                           message=f"Job failed: {reason}: {failed.get('message', '')}".rstrip(": "))
    if condition(job, "Complete", "SuccessCriteriaMet") is not None:
        return Observation(RunPhase.SUCCEEDED, exit_codes=codes, failure_class=FailureClass.SUCCEEDED)
    if job.get("spec", {}).get("suspend"):
        return Observation(RunPhase.PENDING, exit_codes=codes, message="suspended: waiting for queue admission")
    running += sum(1 for code in codes.values() if code == 0)  # finished nodes have started too
    if running >= nodes:
        return Observation(RunPhase.RUNNING, exit_codes=codes, message=f"{running}/{nodes} pods running")
    detail = "; ".join(waiting)
    return Observation(RunPhase.PENDING, exit_codes=codes,
                       message=f"{running}/{nodes} pods running" + (f"; {detail}" if detail else ""))
