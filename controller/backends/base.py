"""The seam between the controller and every place a job can run (local processes, Kubernetes, Azure ML).

Called only by `controller.reconciler` (the one loop that acts on backends); implemented by
`backends/local.py`, `backends/kubernetes/` and `backends/azureml.py`. A backend is told *what* to run
(a `Submission` with a deterministic name) and reports *what it sees* (an `Observation`); it keeps
no job state of its own that the controller relies on, so a restarted controller can pick up runs
a previous process started. Each backend translates its SDK's errors into `BackendError` at this
seam (`raise BackendError(...) from e`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from deepfleet.controller.sources import CheckpointSource
from deepfleet.worker.spec import FailureClass, WorkerSpec

if TYPE_CHECKING:
    from deepfleet.controller.registry import ExportedModel
    from deepfleet.controller.spec import JobSpec

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def run_name(job_name: str, job_id: str, attempt: int) -> str:
    """The deterministic backend name of one attempt: `df-<job>-<id8>-a<attempt>` (DNS-1123 label, <= 63).

    Deterministic so that submitting twice (a crash between submit and commit, two controllers) names
    the same run and the second submit is a no-op.
    """
    name = f"df-{job_name}-{job_id.replace('-', '')[:8].lower()}-a{attempt}"
    if len(name) > 63 or not _DNS_LABEL.match(name):
        raise ValueError(f"backend name {name!r} is not a DNS-1123 label of <= 63 chars; shorten metadata.name")
    return name


@dataclass(frozen=True)
class Submission:
    """One attempt of one job, ready for a backend."""

    name: str  # run_name(job_name, job_id, attempt)
    job_id: str
    attempt: int
    spec: JobSpec
    worker_spec: WorkerSpec
    env: dict[str, str] = field(default_factory=dict)  # DEEPFLEET_JOB_ID, DEEPFLEET_ATTEMPT, ..._TOKEN, ...
    # The job named by `checkpoint.resumeFrom` (a ServingJob's `model.job`), as the controller stored it:
    # the kubernetes and azureml backends mount its checkpoints read-only (None: the job names none).
    checkpoint_source: CheckpointSource | None = None


class RunPhase(str, enum.Enum):
    """The phase of one backend run as the backend sees it."""

    PENDING = "PENDING"  # accepted, not all nodes started yet
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"  # every node exited 0
    FAILED = "FAILED"  # some node exited non-zero (see exit_codes / failure_class)
    NOT_FOUND = "NOT_FOUND"  # no run of that name exists


@dataclass(frozen=True)
class Observation:
    """What a backend reports about one run."""

    phase: RunPhase
    exit_codes: dict[int, int] = field(default_factory=dict)  # node index -> exit code (the known ones)
    failure_class: FailureClass | None = None  # classify_exit() of the worst exit, when FAILED
    message: str = ""
    endpoint: str | None = None  # a serving run's URL once it listens (None: not serving, or not yet)


class BackendError(RuntimeError):
    """A backend call failed. `transient=True`: retry later (API unavailable, throttled); False: the
    request itself is wrong (the reconciler fails the job with the message)."""

    def __init__(self, message: str, *, transient: bool = True) -> None:
        super().__init__(message)
        self.transient = transient


@runtime_checkable
class Backend(Protocol):
    """Where runs execute. Every method may raise `BackendError`; none blocks longer than one API call."""

    name: str

    def submit(self, sub: Submission) -> None:
        """Start the run `sub.name`. Idempotent: an existing run with that name is success."""
        ...

    def observe(self, name: str) -> Observation:
        """Report the run's phase and exit codes; `RunPhase.NOT_FOUND` when no such run exists."""
        ...

    def cancel(self, name: str) -> None:
        """Stop and remove every process/pod of the run. Idempotent: an unknown name is success."""
        ...

    def logs(self, name: str, *, node: int = 0, tail: int | None = None, follow: bool = False) -> Iterator[str]:
        """Lines of node `node`'s log (the last `tail` lines if set); with `follow`, keep yielding until the
        run ends. Raises `BackendError` when the run has no such log."""
        ...


@runtime_checkable
class ModelSource(Protocol):
    """A backend that can hand a succeeded run's exported model (`spec.registerModel`) to a model registry:
    the local backend (a file in the job's area) and Azure ML (the job's model output)."""

    def exported_model(self, run_name: str, *, job_id: str, spec: JobSpec) -> ExportedModel:
        """Where run `run_name` of job `job_id` put its exported model. Raises
        `deepfleet.controller.registry.RegistryError` when it exported none (the message says why)."""
        ...
