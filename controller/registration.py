"""Registering a succeeded job's model (`spec.registerModel`): the reconciler's step after SUCCEEDED.

Called by `controller.reconciler`: `queue(job)` in the transaction that makes a job SUCCEEDED (the job is
marked `registration_state = pending`), and `Registrar.run_once(now)` every pass. The job's phase is never
touched here: a registration that fails leaves the job SUCCEEDED with the failure on it (its
`registration` column) and in its events.

One registration: claim the pending job (the same compare-and-set claim the reconciler uses, so one
replica works on it), read its provenance chain and ask the backend where the run put its exported model
(`ModelSource.exported_model`), then call the registry outside any transaction (an upload may take a
while), and record the outcome: `registered` (an event `ModelRegistered` and a `registration` record in
the provenance chain), `failed` (`RegistrationFailed`) or, for a registry that could not be reached, a
retry after a doubling backoff, at most `max_tries` tries. A crash between the registry's answer and the
commit is safe: the registry adopts the version already tagged with the job on the next try.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from deepfleet.controller.backends.base import Backend, ModelSource
from deepfleet.controller.db import provenance as chain
from deepfleet.controller.db.jobs import claim_free, claim_jobs, record_event
from deepfleet.controller.db.models import Job
from deepfleet.controller.db.outage import is_connection_error
from deepfleet.controller.registry import ModelRegistry, Registered, RegistrationRequest, RegistryError
from deepfleet.controller.spec import stored_spec

log = logging.getLogger(__name__)

PENDING, REGISTERED, FAILED = "pending", "registered", "failed"


def queue(job: Job) -> None:
    """Mark a job that has just SUCCEEDED for registration when its spec asks for one."""
    wanted = (job.spec.get("spec") or {}).get("registerModel")
    if wanted and job.registration_state is None:
        job.registration_state = PENDING
        job.registration = {"name": wanted["name"], "tries": 0}


def job_url(controller_url: str, job_id: str) -> str:
    """The job's page on the controller's web UI (what a registry entry links to)."""
    return f"{controller_url.rstrip('/')}/ui/#/jobs/{job_id}"


class Registrar:
    """Registers the pending jobs of one backend in one registry (None: every such job fails, saying so)."""

    def __init__(self, sessions: sessionmaker[Session], *, backend: Backend, registry: ModelRegistry | None,
                 replica_id: str, controller_url: str, lease_seconds: float = 30.0, batch: int = 10,
                 max_tries: int = 5, backoff_s: float = 10.0, max_backoff_s: float = 600.0) -> None:
        self.sessions = sessions
        self.backend = backend
        self.registry = registry
        self.replica_id = replica_id
        self.controller_url = controller_url
        self.lease_seconds = lease_seconds
        self.batch = batch
        self.max_tries = max_tries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s

    def run_once(self, now: datetime) -> None:
        """Try every pending registration this replica can claim (a few per pass)."""
        for job_id in self._claim(now):
            try:
                self._register(job_id, now)
            except Exception as e:  # one job must not stall the others; its claim expires and it is tried again
                if is_connection_error(e):
                    raise
                log.exception("job %s: registration failed", job_id)

    def _claim(self, now: datetime) -> list[str]:
        free = claim_free(self.replica_id, now)
        mine = (Job.backend == self.backend.name, Job.registration_state == PENDING, Job.phase == "SUCCEEDED")
        return claim_jobs(self.sessions, where=(*mine, free), recheck=(*mine, free),
                          order_by=(Job.finished_at, Job.id), limit=self.batch, replica_id=self.replica_id,
                          until=now + timedelta(seconds=self.lease_seconds))

    def _register(self, job_id: str, now: datetime) -> None:
        with self.sessions() as s:
            job = s.get(Job, job_id)
            if job is None or job.claimed_by != self.replica_id or job.registration_state != PENDING:
                return
            state = dict(job.registration or {})
            if state.get("retry_at") and now < datetime.fromisoformat(state["retry_at"]):
                self._release(s, job)
                s.commit()
                return
            problem: str | None = None
            try:
                request: RegistrationRequest | None = self._request(s, job, state["name"])
            except ValueError as e:  # RegistryError, or a stored spec that no longer validates
                request, problem = None, str(e)
        result: Registered | None = None
        retry: str | None = None
        if request is not None:
            try:
                assert self.registry is not None  # _request raised otherwise
                result = self.registry.register(request)
            except RegistryError as e:
                problem = str(e)
            except Exception as e:  # the registry's own failure (unreachable, 5xx): worth another try
                problem = f"{type(e).__name__}: {e}".splitlines()[0][:2000]
                retry = problem
        with self.sessions() as s, s.begin():
            job = s.get(Job, job_id)
            if job is None or job.registration_state != PENDING:
                return
            self._record(s, job, state, now, result=result, problem=None if result else problem, retry=retry,
                         request=request)
            self._release(s, job)

    def _request(self, s: Session, job: Job, name: str) -> RegistrationRequest:
        if self.registry is None:
            raise RegistryError(f"this controller has no model registry for backend {self.backend.name}")
        if not isinstance(self.backend, ModelSource):
            raise RegistryError(f"backend {self.backend.name} cannot hand a job's exported model to a registry")
        spec = stored_spec(job.spec)
        run_name = next(a.run_name for a in job.attempts if a.number == job.current_attempt)
        model = self.backend.exported_model(run_name, job_id=job.id, spec=spec)
        return RegistrationRequest(name=name, job_id=job.id, job_name=job.name, project=job.project,
                                   job_url=job_url(self.controller_url, job.id),
                                   records=[chain.as_dict(r) for r in chain.records(s, job.id)], model=model)

    def _record(self, s: Session, job: Job, state: dict[str, Any], now: datetime, *, result: Registered | None,
                problem: str | None, retry: str | None, request: RegistrationRequest | None) -> None:
        tries = int(state.get("tries", 0)) + 1
        kind = self.registry.kind if self.registry is not None else None
        state = {**state, "registry": kind, "tries": tries, "retry_at": None}
        if result is not None:
            assert request is not None
            job.registration_state = REGISTERED
            job.registration = {**state, "version": result.version, "uri": result.uri, "source": result.source,
                                "error": None, "registered_at": now.isoformat()}
            message = f"registered {result.name} version {result.version} in {kind} ({result.uri or result.source})"
            _event(s, job, "ModelRegistered", message, now, actor=self.replica_id)
            if chain.recorded(s, job.id, "registration", name=result.name, version=result.version):
                return  # a try whose commit was lost (the registry adopted its version)
            chain.append(s, job.id, "registration", {
                "registry": kind, "name": result.name, "version": result.version, "uri": result.uri,
                "source": result.source, "provenance_head": request.head,
                "checkpoint": request.model.manifest.get("checkpoint"),
                "file_sha256": request.model.manifest.get("sha256"),
            }, attempt=job.current_attempt, time=now)
            return
        if retry is not None and tries < self.max_tries:
            wait = min(self.max_backoff_s, self.backoff_s * 2 ** (tries - 1))
            job.registration = {**state, "error": retry, "retry_at": (now + timedelta(seconds=wait)).isoformat()}
            _event(s, job, "RegistrationRetrying", f"try {tries} of {self.max_tries} failed: {retry}; next in "
                   f"{wait:.0f}s", now, actor=self.replica_id)
            return
        job.registration_state = FAILED
        job.registration = {**state, "error": problem}
        _event(s, job, "RegistrationFailed", f"model {state['name']} not registered: {problem}", now,
               actor=self.replica_id)

    @staticmethod
    def _release(s: Session, job: Job) -> None:
        job.claimed_by, job.claim_expires_at = None, None


def _event(s: Session, job: Job, reason: str, message: str, now: datetime, *, actor: str) -> None:
    record_event(s, job.id, actor=actor, type=reason, message=message, attempt=job.current_attempt, time=now)
