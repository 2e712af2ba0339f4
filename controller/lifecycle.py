"""Job lifecycle: the phases, the transition table, and the pure `decide()` the reconciler applies.

Called by `controller.reconciler` (which performs the returned `Action` and records an event) and
by the API/CLI for `is_terminal()`. Nothing here does I/O or reads a clock: `decide(job, observed,
now)` is a function of its arguments, so every rule below is a row in a table test.

    PENDING ──admit──> ADMITTED ──observed running──> RUNNING ──exit 0──> SUCCEEDED
       │                  │                            │  ▲
       │                  │ failed, retryable          │  │ observed running
       │                  └──────────────> RESTARTING <┘  │  (after backoff, attempt+1)
       │                                       │ └────────┘
       │                                       └─ budget spent / not retryable ──> FAILED
       └── cancel requested (from any non-terminal phase) ──> CANCELLED

Failure ladder (exit codes from `deepfleet.worker.spec`, classified by `classify_exit`):
- 75 preempted-resumable: restart, not counted against the restart budget;
- 64 invalid spec/config: fail, never retry (the same spec would fail again);
- 65 user code raised: restart only when `restartPolicy` allows user-error retries;
- 77 out of memory: fail without a blind retry; the event says what to change;
- 76 communication failure and 128+N signals (node loss): restart while budget remains;
- a RUNNING attempt that sent heartbeats and then fell silent for `hang_after` is treated as hung
  (a communication failure): restarted while budget remains.
Each restart is a new attempt (a new deterministic backend name) after an exponential backoff,
and resumes from the latest complete checkpoint (the worker finds it; the event names it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime, timedelta

from deepfleet.controller.backends.base import Observation, RunPhase
from deepfleet.worker.spec import FailureClass, RestartPolicy

_DEFAULT_POLICY = RestartPolicy()  # the restart defaults live in RestartPolicy only


class Phase(str, enum.Enum):
    """The phase of a job as the controller records it."""

    PENDING = "PENDING"
    ADMITTED = "ADMITTED"
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    def is_terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({Phase.SUCCEEDED, Phase.FAILED, Phase.CANCELLED})

# Allowed moves. ADMITTED may jump straight to a result: a short job can finish between two observations.
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.PENDING: frozenset({Phase.ADMITTED, Phase.CANCELLED, Phase.FAILED}),
    Phase.ADMITTED: frozenset({Phase.RUNNING, Phase.RESTARTING, Phase.SUCCEEDED, Phase.FAILED, Phase.CANCELLED}),
    Phase.RUNNING: frozenset({Phase.RESTARTING, Phase.SUCCEEDED, Phase.FAILED, Phase.CANCELLED}),
    Phase.RESTARTING: frozenset({Phase.RUNNING, Phase.RESTARTING, Phase.SUCCEEDED, Phase.FAILED, Phase.CANCELLED}),
    Phase.SUCCEEDED: frozenset(),
    Phase.FAILED: frozenset(),
    Phase.CANCELLED: frozenset(),
}

# Phases in which a backend run may exist and must be observed.
ACTIVE = frozenset({Phase.ADMITTED, Phase.RUNNING, Phase.RESTARTING})

MAX_BACKOFF_S = 600.0

OOM_ADVICE = (
    "out of memory: retrying unchanged would fail again; lower train_micro_batch_size_per_gpu, enable "
    "activation checkpointing, raise zero_optimization.stage or enable offload, or request GPUs with more memory"
)


def is_terminal(phase: Phase | str) -> bool:
    """True for SUCCEEDED, FAILED and CANCELLED."""
    return Phase(phase) in TERMINAL


def can_transition(src: Phase, dst: Phase) -> bool:
    """True when the transition table allows `src -> dst`."""
    return dst in TRANSITIONS[src]


class IllegalTransition(RuntimeError):
    """A programmer error: the reconciler tried a move the table forbids."""


def check_transition(src: Phase, dst: Phase) -> None:
    """Raise `IllegalTransition` unless `src -> dst` is allowed."""
    if not can_transition(src, dst):
        raise IllegalTransition(f"{src.value} -> {dst.value} is not an allowed transition")


class Kind(str, enum.Enum):
    """What the reconciler should do for one job now."""

    NOTHING = "nothing"  # wait; nothing changed
    SUBMIT = "submit"  # submit the current attempt (idempotent; same name on resubmit)
    MARK = "mark"  # record a phase change only (e.g. ADMITTED -> RUNNING, -> SUCCEEDED)
    RESTART = "restart"  # cancel what is left of the attempt, attempt += 1, RESTARTING until not_before
    FAIL = "fail"  # cancel what is left of the run, FAILED
    CANCEL = "cancel"  # cancel the backend run (if any), CANCELLED


@dataclass(frozen=True)
class JobState:
    """The controller's view of one job that `decide` needs (filled from the database row)."""

    phase: Phase
    attempt: int = 0
    restarts: int = 0  # restarts counted against the budget so far
    max_restarts: int = _DEFAULT_POLICY.max_restarts
    backoff_seconds: float = _DEFAULT_POLICY.backoff_seconds
    retry_user_errors: bool = _DEFAULT_POLICY.retry_on_user_error
    cancel_requested: bool = False
    submitted: bool = False  # a submit intent is recorded for the current attempt
    not_before: datetime | None = None  # RESTARTING: earliest time to submit the next attempt
    last_checkpoint: str | None = None  # latest complete checkpoint reported by heartbeats
    last_heartbeat_at: datetime | None = None  # newest heartbeat of the current attempt (None: none yet)
    hang_after: timedelta | None = None  # silence after a first heartbeat that counts as a hang; None: off


@dataclass(frozen=True)
class Action:
    """The reconciler's instruction: do `kind`, then move to `phase` (if set) and record `reason`/`message`."""

    kind: Kind
    phase: Phase | None = None
    reason: str = ""
    message: str = ""
    counts: bool = False  # RESTART: counts against the restart budget
    not_before: datetime | None = None  # RESTART: when the next attempt may be submitted
    failure: FailureClass | None = None  # RESTART/FAIL: the class the decision was made on


NOTHING = Action(Kind.NOTHING)


def backoff(job: JobState) -> timedelta:
    """Exponential backoff for the next attempt: base * 2**restarts, capped at MAX_BACKOFF_S."""
    seconds = job.backoff_seconds * (2 ** min(job.restarts, 16))
    return timedelta(seconds=min(seconds, MAX_BACKOFF_S))


def decide(job: JobState, observed: Observation | None, now: datetime) -> Action:
    """The one decision for `job` given what the backend reports (`None`: not observed / no run yet)."""
    if job.phase.is_terminal():
        return NOTHING
    if job.cancel_requested:
        return Action(Kind.CANCEL, Phase.CANCELLED, reason="Cancelled", message="cancelled on request")
    if job.phase is Phase.PENDING:
        return NOTHING  # admission is the scheduler's decision, not a reaction to the backend
    if job.phase is Phase.RESTARTING and not job.submitted:
        if job.not_before is not None and now < job.not_before:
            return NOTHING
        return _submit(job, resume=True)
    if not job.submitted:
        return _submit(job, resume=False)
    if observed is None:
        return NOTHING
    return _react(job, observed, now)


def _submit(job: JobState, *, resume: bool) -> Action:
    where = f"; resuming from {job.last_checkpoint}" if resume and job.last_checkpoint else ""
    return Action(Kind.SUBMIT, reason="Submitted", message=f"attempt {job.attempt} submitted{where}")


def _react(job: JobState, observed: Observation, now: datetime) -> Action:
    phase = observed.phase
    if phase is RunPhase.PENDING:
        return NOTHING
    if phase is RunPhase.RUNNING:
        if job.phase is Phase.RUNNING:
            silent = now - job.last_heartbeat_at if job.last_heartbeat_at is not None else None
            if job.hang_after is not None and silent is not None and silent > job.hang_after:
                # It did send heartbeats, then went quiet: a hung collective or a wedged process.
                detail = f"no heartbeat for {silent.total_seconds():.0f}s (limit {job.hang_after.total_seconds():g}s)"
                return _failed(job, FailureClass.COMM_FAILURE, f"{detail}; presumed hung", now)
            return NOTHING
        return Action(Kind.MARK, Phase.RUNNING, reason="Running", message=f"attempt {job.attempt} running")
    if phase is RunPhase.SUCCEEDED:
        return Action(Kind.MARK, Phase.SUCCEEDED, reason="Succeeded", message=f"attempt {job.attempt} succeeded")
    if phase is RunPhase.NOT_FOUND:
        if job.phase is Phase.RUNNING:
            # It was seen running and is gone (deleted behind our back, node lost): a failed attempt.
            return _failed(job, FailureClass.NODE_LOST, "the run disappeared from the backend", now)
        # Submit intent recorded but the backend never got it (crash between intent and submit).
        return Action(Kind.SUBMIT, reason="Resubmitted", message=f"attempt {job.attempt} not found; resubmitting")
    detail = observed.message or f"exit codes {observed.exit_codes}"
    return _failed(job, observed.failure_class, detail, now)


def _failed(job: JobState, fc: FailureClass | None, detail: str, now: datetime) -> Action:
    label = fc.value if fc is not None else "unknown"
    if fc is FailureClass.INVALID_SPEC:
        return Action(Kind.FAIL, Phase.FAILED, reason="InvalidSpec", message=f"invalid spec, not retried: {detail}",
                      failure=fc)
    if fc is FailureClass.OOM:
        return Action(Kind.FAIL, Phase.FAILED, reason="OutOfMemory", message=f"{OOM_ADVICE} ({detail})", failure=fc)
    if fc is FailureClass.USER_ERROR and not job.retry_user_errors:
        return Action(
            Kind.FAIL,
            Phase.FAILED,
            reason="UserError",
            message=f"the training code raised, not retried (the restart policy does not retry user errors): "
            f"{detail}; fix the code and resubmit",
            failure=fc,
        )
    counts = fc is not FailureClass.PREEMPTED
    if counts and job.restarts >= job.max_restarts:
        return Action(
            Kind.FAIL,
            Phase.FAILED,
            reason="RestartBudgetExhausted",
            message=f"{label}: {detail}; {job.restarts}/{job.max_restarts} restarts used",
            failure=fc,
        )
    wait = backoff(job)
    resume = f", resuming from {job.last_checkpoint}" if job.last_checkpoint else ""
    return Action(
        Kind.RESTART,
        Phase.RESTARTING,
        reason="Preempted" if not counts else "Restarting",
        message=f"{label}: {detail}; attempt {job.attempt + 1} in {wait.total_seconds():g}s{resume}",
        counts=counts,
        not_before=now + wait,
        failure=fc,
    )
