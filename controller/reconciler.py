"""The reconciler: the one loop that acts on backends. Desired state is in the database, observed state
in the backend; each pass moves the one toward the other and records every transition as an event.

Called by the server (`deepfleet server` runs `Reconciler.run` in a thread beside the API), by the demo
and by tests, which call `reconcile_once(now)` with an injected time instead of sleeping.

One pass:
1. **Admit** (only the replica holding the `scheduler-<backend>` lease): PENDING jobs of this backend
   go through `controller.scheduler.admit` against per-queue quotas and the backend's capacity. The
   decision reads a lock-free snapshot of a few columns of the first `admit_window` jobs in rank order
   (`scheduler.ranked_window`, so a pass costs the same over 100 or 100,000 pending jobs); at most
   `admit_budget` decisions are applied
   per pass, in transactions locking at most `admit_batch` rows (`FOR UPDATE SKIP LOCKED` on
   PostgreSQL), so a cancel or submit never waits behind a pass over a long queue.
   (One reconciler drives one backend; a controller with several backends runs one per backend.)
2. **Claim** active jobs (ADMITTED, RUNNING, RESTARTING, or any with a cancel request). On PostgreSQL
   `SELECT ... FOR UPDATE SKIP LOCKED` picks rows no other replica is claiming right now; the claim
   itself (`claimed_by`, `claim_expires_at`) is a compare-and-set UPDATE, which is also the whole
   mechanism on SQLite (one writer at a time makes the CAS atomic). A claim is renewed each pass and
   expires after `lease_seconds`, so a dead replica's jobs move to a live one.
3. **Act** on each claimed job: observe its current run, `lifecycle.decide()`, perform the action.
4. **Register** the models of jobs that succeeded and asked for it (`controller.registration`).

Crash safety: before `Backend.submit` the attempt row (run name = the submit intent) is committed;
after a crash the next owner observes first. A run that exists is adopted (the backend's submit is
idempotent on the deterministic name); `NOT_FOUND` after a recorded intent resubmits the same name.
So a crash at any point neither loses a job nor starts it twice.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from sqlalchemy import bindparam, insert, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from deepfleet.controller import lifecycle, registration, scheduler
from deepfleet.controller import provenance as prov
from deepfleet.controller.backends.base import Backend, BackendError, Observation, RunPhase
from deepfleet.controller.compile import compile_submission
from deepfleet.controller.confine import code_dir_for
from deepfleet.controller.db import provenance as chain
from deepfleet.controller.db.jobs import claim_free, claim_jobs, record_event
from deepfleet.controller.db.models import PRIORITIES, Attempt, Event, Job, Lease, Queue
from deepfleet.controller.db.outage import Outage, is_connection_error
from deepfleet.controller.lifecycle import Action, JobState, Kind, Phase
from deepfleet.controller.registry import ModelRegistry
from deepfleet.controller.sources import CheckpointSource, checkpoint_source
from deepfleet.controller.spec import AnyJob, is_serving, stored_spec
from deepfleet.worker.spec import FailureClass, RestartPolicy

log = logging.getLogger(__name__)

SCHEDULER_LEASE = "scheduler"
# Phases the reconciler works on (PENDING only when a cancel was requested; admission handles the rest).
CLAIMABLE = (Phase.ADMITTED.value, Phase.RUNNING.value, Phase.RESTARTING.value)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


@dataclass(frozen=True)
class ReconcilerConfig:
    """How one reconciler replica behaves."""

    replica_id: str
    controller_url: str  # where workers post heartbeats
    secret: str  # key of the job-scoped worker tokens
    backend_name: str = "local"
    capacity: scheduler.Limit = scheduler.UNLIMITED
    lease_seconds: float = 30.0
    aging_s: float = 600.0
    batch: int = 100  # jobs claimed per pass
    admit_window: int = 1000  # pending jobs (first in rank order) a pass reads and decides on
    admit_budget: int = 500  # admission decisions applied per pass (the rest: next pass)
    admit_batch: int = 100  # rows locked at once by admission (one transaction each)
    heartbeat_interval_s: float | None = None
    hang_timeout_s: float | None = 1800.0  # heartbeat silence (after a first one) that counts as a hang


class Reconciler:
    """Drives every job toward its desired state on one backend."""

    def __init__(self, sessions: sessionmaker[Session], *, backend: Backend, config: ReconcilerConfig,
                 outage: Outage | None = None, registry: ModelRegistry | None = None) -> None:
        """`outage`: where an unreachable database is reported (the API's, so a controller logs it once);
        `registry`: where succeeded jobs' models go when their spec asks (`spec.registerModel`)."""
        self.sessions = sessions
        self.backend = backend
        self.config = config
        self.outage = outage or Outage()
        self.registrar = registration.Registrar(sessions, backend=backend, registry=registry,
                                                replica_id=config.replica_id, controller_url=config.controller_url,
                                                lease_seconds=config.lease_seconds)

    # ------------------------------------------------------------------ the loop
    def run(self, stop: threading.Event, *, interval_s: float = 2.0, clock: Callable[[], datetime] = utcnow) -> None:
        """Reconcile every `interval_s` until `stop` is set. A failing pass is logged, never fatal."""
        while not stop.is_set():
            try:
                self.reconcile_once(clock())
            except Exception as e:  # best-effort loop: the next pass retries from the database
                if is_connection_error(e):
                    self.outage.failed(e)  # one line per outage, not one per pass
                else:
                    log.exception("reconcile pass failed")
            else:
                self.outage.recovered()
            stop.wait(interval_s)

    def reconcile_once(self, now: datetime) -> None:
        """One pass: admit (if this replica holds the scheduler lease), claim, act."""
        if self._hold_lease(f"{SCHEDULER_LEASE}-{self.config.backend_name}", now):
            self._admit(now)
        for job_id in self._claim(now):
            try:
                self._reconcile_job(job_id, now)
            except Exception as e:  # one bad job must not stall the others; its claim expires and it is retried
                if is_connection_error(e):
                    raise  # the database, not the job: the loop reports the outage once
                log.exception("job %s: reconcile failed", job_id)
        self.registrar.run_once(now)

    # ------------------------------------------------------------------ leases and claims
    def _hold_lease(self, name: str, now: datetime) -> bool:
        me, until = self.config.replica_id, now + timedelta(seconds=self.config.lease_seconds)
        with self.sessions() as s, s.begin():
            got = s.execute(
                update(Lease)
                .where(Lease.name == name, or_(Lease.holder == me, Lease.expires_at < now))
                .values(holder=me, expires_at=until, renewed_at=now)
            ).rowcount
            if got:
                return True
            if s.get(Lease, name) is not None:
                return False
        try:
            with self.sessions() as s, s.begin():
                s.add(Lease(name=name, holder=me, expires_at=until, renewed_at=now))
        except IntegrityError:
            return False  # another replica created the lease first: it holds it
        return True

    def _claimable(self, now: datetime):  # noqa: ANN202 - a SQLAlchemy boolean clause
        me = self.config.replica_id
        return (
            Job.backend == self.config.backend_name,
            or_(Job.phase.in_(CLAIMABLE), (Job.desired_state == "cancel_requested") & (Job.phase == Phase.PENDING.value)),
            claim_free(me, now),
        )

    def _claim(self, now: datetime) -> list[str]:
        """Claim up to `batch` active jobs for this replica; returns their ids (oldest first)."""
        backend_clause, phase_clause, free_clause = self._claimable(now)
        return claim_jobs(self.sessions, where=(backend_clause, phase_clause, free_clause), recheck=(free_clause,),
                          order_by=(Job.created_at, Job.id), limit=self.config.batch,
                          replica_id=self.config.replica_id,
                          until=now + timedelta(seconds=self.config.lease_seconds), skip_locked=True)

    # ------------------------------------------------------------------ admission
    def _admit(self, now: datetime) -> None:
        """Decide on a lock-free snapshot of the first `admit_window` PENDING rows in rank order (each base
        priority's oldest, merged), then apply at most `admit_budget` decisions
        (in rank order) in transactions of at most `admit_batch` rows, each row locked only while it
        changes. Rows another transaction holds (a cancel in flight) are skipped and decided again next
        pass, so a pass over thousands of pending jobs never blocks a cancel or a submit."""
        window = self.config.admit_window
        with self.sessions() as s:
            streams = [[scheduler.QueuedJob(job_id, queue, level, scheduler.Demand(procs, gpus), created)
                        for job_id, queue, procs, gpus, created in s.execute(
                            select(Job.id, Job.queue, Job.world_size, Job.gpus, Job.created_at)
                            .where(*self._pending(), Job.priority == priority)
                            .order_by(Job.created_at, Job.id).limit(window))]
                       for priority, level in ((p, scheduler.Priority.parse(p)) for p in PRIORITIES)]
            if not any(streams):
                return
            used: dict[str, scheduler.Demand] = {}
            for queue, procs, gpus in s.execute(
                select(Job.queue, Job.world_size, Job.gpus).where(Job.phase.in_(CLAIMABLE),
                                                                  Job.backend == self.config.backend_name)
            ):
                used[queue] = used.get(queue, scheduler.ZERO) + scheduler.Demand(procs, gpus)
            quotas = {q.name: scheduler.Limit(q.max_processes, q.max_gpus) for q in s.scalars(select(Queue))}
        queued = scheduler.ranked_window(streams, window, now=now, aging_s=self.config.aging_s)
        out = scheduler.admit(queued, used=used, capacity=self.config.capacity, quotas=quotas, now=now,
                              aging_s=self.config.aging_s)
        # Admissions first (rank order), then failures; the head-of-line note last (it only sets a message).
        decisions: list[tuple[str, Phase | None, str]] = [(j, Phase.ADMITTED, "") for j in out.admitted]
        decisions += [(j, Phase.FAILED, why) for j, why in out.unschedulable.items()]
        if out.reserved_for is not None:
            decisions.append((out.reserved_for, None, ""))
        decisions = decisions[: self.config.admit_budget]
        for start in range(0, len(decisions), self.config.admit_batch):
            self._apply_admission(decisions[start: start + self.config.admit_batch], now)

    def _pending(self) -> tuple:
        return (Job.phase == Phase.PENDING.value, Job.desired_state == "run", Job.backend == self.config.backend_name)

    def _apply_admission(self, batch: list[tuple[str, Phase | None, str]], now: datetime) -> None:
        """One transaction: lock the batch's rows that are still PENDING (skipping locked ones) and change
        them with set-based statements (a few round trips per batch, no ORM objects)."""
        with self.sessions() as s, s.begin():
            query = select(Job.id, Job.queue, Job.world_size, Job.gpus, Job.current_attempt).where(
                Job.id.in_([job_id for job_id, _, _ in batch]), *self._pending())
            if s.get_bind().dialect.name == "postgresql":
                query = query.with_for_update(skip_locked=True)
            rows = {r.id: r for r in s.execute(query)}  # the rest: cancelled, changed or locked; next pass
            changes, events = [], []
            for job_id, phase, why in batch:
                if (row := rows.get(job_id)) is None:
                    continue
                if phase is None:  # say why the head of the line waits (a message, not an event)
                    changes.append({"b_id": job_id, "b_phase": Phase.PENDING.value, "b_finished": None,
                                    "b_message": f"next in line: waiting for {row.world_size} processes / "
                                                 f"{row.gpus} GPUs to free up; later jobs wait behind it"})
                    continue
                lifecycle.check_transition(Phase.PENDING, phase)
                reason, message = (("Admitted", f"admitted to queue {row.queue}") if phase is Phase.ADMITTED
                                   else ("Unschedulable", why))
                changes.append({"b_id": job_id, "b_phase": phase.value, "b_message": message,
                                "b_finished": now if phase.is_terminal() else None})
                events.append({"job_id": job_id, "time": now, "actor": self.config.replica_id, "type": reason,
                               "message": message, "attempt": row.current_attempt, "data": None})
            if changes:
                s.connection().execute(
                    update(Job.__table__).where(Job.__table__.c.id == bindparam("b_id")).values(
                        phase=bindparam("b_phase"), message=bindparam("b_message"),
                        finished_at=bindparam("b_finished")),
                    changes,
                )
            if events:
                s.execute(insert(Event), events)

    # ------------------------------------------------------------------ one job
    def _reconcile_job(self, job_id: str, now: datetime) -> None:
        with self.sessions() as s:
            job = s.get(Job, job_id)
            if job is None or job.claimed_by != self.config.replica_id:
                return
            attempt = self._attempt(s, job)
            observed = None
            if attempt is not None:
                try:
                    observed = self.backend.observe(attempt.run_name)
                except BackendError as e:
                    log.warning("observe %s failed: %s", attempt.run_name, e)
                    return
            state = self._state(job, attempt, hang_timeout_s=self.config.hang_timeout_s)
            action = lifecycle.decide(state, observed, now)
            try:
                self._apply(s, job, attempt, action, observed, now)
            except BackendError as e:
                s.rollback()
                if e.transient:
                    log.warning("job %s: %s failed, will retry: %s", job_id, action.kind.value, e)
                    return
                job = s.get(Job, job_id)
                self._transition(s, job, Phase.FAILED, "BackendError", str(e), now)
            except ValueError as e:  # the stored spec no longer validates (an older version stored it): a user error
                s.rollback()
                job = s.get(Job, job_id)
                self._transition(s, job, Phase.FAILED, "InvalidSpec", str(e), now)
            if job.phase in (p.value for p in lifecycle.TERMINAL):
                job.claimed_by, job.claim_expires_at = None, None
            s.commit()

    @staticmethod
    def _attempt(s: Session, job: Job) -> Attempt | None:
        return s.scalars(
            select(Attempt).where(Attempt.job_id == job.id, Attempt.number == job.current_attempt)
        ).one_or_none()

    @staticmethod
    def _state(job: Job, attempt: Attempt | None, *, hang_timeout_s: float | None = None) -> JobState:
        policy = RestartPolicy.model_validate(job.spec.get("spec", {}).get("restartPolicy", {}))
        counted = sum(n for fc, n in (job.restart_counts or {}).items() if fc != FailureClass.PREEMPTED.value)
        return JobState(
            phase=Phase(job.phase),
            attempt=job.current_attempt,
            restarts=counted,
            max_restarts=policy.max_restarts,
            backoff_seconds=policy.backoff_seconds,
            retry_user_errors=policy.retry_on_user_error,
            cancel_requested=job.desired_state == "cancel_requested",
            submitted=attempt is not None,
            not_before=job.not_before,
            last_checkpoint=(job.last_heartbeat or {}).get("last_complete_checkpoint"),
            last_heartbeat_at=_attempt_heartbeat(job, attempt),
            hang_after=timedelta(seconds=hang_timeout_s) if hang_timeout_s else None,
        )

    def _apply(self, s: Session, job: Job, attempt: Attempt | None, action: Action,
               observed: Observation | None, now: datetime) -> None:
        if action.kind is Kind.NOTHING:
            job.claim_expires_at = now + timedelta(seconds=self.config.lease_seconds)
            if (observed is not None and observed.phase is RunPhase.RUNNING and observed.endpoint
                    and observed.endpoint != job.endpoint):
                job.endpoint = observed.endpoint  # a serving run that moved (a new attempt listens elsewhere)
                _event(s, job, "Serving", f"serving at {observed.endpoint}", now, actor=self.config.replica_id)
            if (attempt is not None and observed is not None and observed.phase is RunPhase.RUNNING
                    and observed.message and observed.message != attempt.message):
                # e.g. an elastic run lost a node and carries on smaller: no phase change, still news
                attempt.message = observed.message
                _event(s, job, "Degraded", observed.message, now, actor=self.config.replica_id,
                       data={"exit_codes": observed.exit_codes})
            return
        if action.kind is Kind.SUBMIT:
            self._submit(s, job, attempt, action, now)
            return
        if attempt is not None and observed is not None:
            _record_observation(attempt, observed, now)
        if action.kind in (Kind.RESTART, Kind.FAIL, Kind.CANCEL) and attempt is not None:
            self.backend.cancel(attempt.run_name)  # leftovers of a failed attempt; the whole run on cancel
            if attempt.finished_at is None:
                attempt.finished_at = now
        if action.kind is Kind.RESTART:
            fc = (action.failure or FailureClass.UNKNOWN).value
            counts = dict(job.restart_counts or {})
            counts[fc] = counts.get(fc, 0) + 1
            job.restart_counts = counts
            job.current_attempt += 1
            job.not_before = action.not_before
        message = action.message
        if action.kind is Kind.MARK and action.phase is Phase.RUNNING and attempt is not None:
            attempt.started_at = attempt.started_at or now
            if observed is not None and observed.endpoint:
                job.endpoint = observed.endpoint
                message = f"{message}; serving at {observed.endpoint}"
        assert action.phase is not None
        self._transition(s, job, action.phase, action.reason, message, now,
                         data={"exit_codes": observed.exit_codes} if observed and observed.exit_codes else None)

    def _submit(self, s: Session, job: Job, attempt: Attempt | None, action: Action, now: datetime) -> None:
        spec = stored_spec(job.spec)
        sub = compile_submission(
            spec, job_id=job.id, attempt=job.current_attempt, controller_url=self.config.controller_url,
            secret=self.config.secret, heartbeat_interval_s=self.config.heartbeat_interval_s,
            checkpoint_source=_checkpoint_source(s, job, spec),
        )
        if attempt is None:
            # The intent, committed before the backend is touched (see the module docstring).
            attempt = Attempt(job_id=job.id, number=job.current_attempt, backend=self.backend.name,
                              run_name=sub.name, phase=RunPhase.PENDING.value,
                              nodes=sub.worker_spec.nodes.max, exit_codes={})
            s.add(attempt)
            append_attempt_record(s, job, attempt, now, workdir=getattr(self.backend, "workdir", None))
            job.claim_expires_at = now + timedelta(seconds=self.config.lease_seconds)
            s.commit()
        self.backend.submit(sub)
        attempt.submitted_at = now
        _event(s, job, action.reason, f"{action.message} as {sub.name}", now, actor=self.config.replica_id)

    def _transition(self, s: Session, job: Job, phase: Phase, reason: str, message: str, now: datetime,
                    *, data: dict | None = None) -> None:
        src = Phase(job.phase)
        if src is not phase:
            lifecycle.check_transition(src, phase)
        job.phase = phase.value
        job.message = message
        if phase is not Phase.RUNNING:
            job.endpoint = None  # stopped, restarting or finished: nothing answers there any more
        if phase.is_terminal():
            job.finished_at = now
        if phase is Phase.SUCCEEDED:
            registration.queue(job)  # registered after this commit, by the registrar (never inside it)
        _event(s, job, reason, message, now, actor=self.config.replica_id, data=data)


def _checkpoint_source(s: Session, job: Job, spec: AnyJob) -> CheckpointSource | None:
    """The stored record of the job `checkpoint.resumeFrom` (a ServingJob's `model.job`) names, as the
    backends mount it; raises ValueError (the job fails) when it is gone or another project's."""
    name = spec.spec.checkpoint.resume_from if spec.spec.checkpoint is not None else None
    if name is None:
        return None
    found = s.get(Job, name)
    if found is None or found.project != job.project:
        field = "spec.model.job" if is_serving(spec) else "spec.checkpoint.resumeFrom"
        raise ValueError(f"{field}: job {name!r} is not a job of project {job.project!r} any more; name one that is")
    return checkpoint_source(found.id, project=found.project, backend=found.backend, document=found.spec)


def _attempt_heartbeat(job: Job, attempt: Attempt | None) -> datetime | None:
    """The newest heartbeat time if it belongs to the current attempt (sent after it was submitted)."""
    if attempt is None or job.last_heartbeat_at is None or attempt.submitted_at is None:
        return None
    return job.last_heartbeat_at if job.last_heartbeat_at >= attempt.submitted_at else None


def _record_observation(attempt: Attempt, observed: Observation, now: datetime) -> None:
    attempt.phase = observed.phase.value
    attempt.exit_codes = {str(k): v for k, v in observed.exit_codes.items()}
    if observed.failure_class is not None:
        attempt.failure_class = observed.failure_class.value
    if observed.message:
        attempt.message = observed.message
    if observed.phase in (RunPhase.SUCCEEDED, RunPhase.FAILED):
        attempt.finished_at = attempt.finished_at or now


def _event(s: Session, job: Job, reason: str, message: str, now: datetime, *, actor: str,
           data: dict | None = None) -> None:
    record_event(s, job.id, actor=actor, type=reason, message=message, attempt=job.current_attempt, data=data,
                 time=now)


def append_attempt_record(s: Session, job: Job, attempt: Attempt, now: datetime, *, workdir: str | None) -> None:
    """The attempt's provenance record: its run, the code it runs (the image and its digest on a
    cluster; the script's or factory module's sha256 and git commit locally, resolved in the local
    backend's `workdir`) and what it resumes from (the newest complete checkpoint an earlier attempt
    reported, with the attempt that wrote it, or the job named in checkpoint.resumeFrom)."""
    document = job.spec.get("spec", {})
    code: dict = prov.image_identity(document.get("image"))
    if attempt.backend == "local":
        root = code_dir_for(workdir or ".", project=job.project)
        code = {**code, **prov.local_code_identity(document.get("entrypoint", {}), root)}
    resumed: dict | None = None
    saved = [r for r in chain.records(s, job.id) if r.kind == "checkpoint"]
    if attempt.number > 0 and saved:
        resumed = {"attempt": saved[-1].data["attempt"], "tag": saved[-1].data["tag"], "step": saved[-1].data["step"]}
    elif (document.get("checkpoint") or {}).get("resumeFrom"):
        resumed = {"job": document["checkpoint"]["resumeFrom"]}
    chain.append(s, job.id, "attempt", {
        "attempt": attempt.number, "backend": attempt.backend, "run_name": attempt.run_name,
        "nodes": attempt.nodes, "code": code, "deepfleet_version": prov.deepfleet_version(),
        "resumed_from": resumed,
    }, attempt=attempt.number, time=now)
