"""Appending to and reading a job's provenance chain (`controller.provenance` defines the records).

Called by `controller.db.jobs` (submit; heartbeats bring runtime, dataset and checkpoint records), the
reconciler (one attempt record when it creates an attempt) and the API. Appends only: no function
here updates or deletes a record. Concurrent appenders of one job serialize on the job row
(`SELECT ... FOR UPDATE` on PostgreSQL) and the (job_id, seq) unique constraint backs that up.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from deepfleet.controller.db.models import Job, ProvenanceRecord, utcnow
from deepfleet.controller.provenance import GENESIS, KINDS, record_hash, verify_chain


def as_dict(r: ProvenanceRecord) -> dict[str, Any]:
    return {"job_id": r.job_id, "seq": r.seq, "kind": r.kind, "attempt": r.attempt, "time": r.time,
            "data": r.data, "prev_hash": r.prev_hash, "hash": r.hash}


def records(session: Session, job_id: str) -> list[ProvenanceRecord]:
    return list(session.scalars(
        select(ProvenanceRecord).where(ProvenanceRecord.job_id == job_id).order_by(ProvenanceRecord.seq)
    ).all())


def append(session: Session, job_id: str, kind: str, data: dict[str, Any], *, attempt: int | None = None,
           time: datetime | None = None) -> ProvenanceRecord:
    """Add the next record of the job's chain (flushed; committed with the caller's transaction)."""
    if kind not in KINDS:
        raise ValueError(f"provenance kind {kind!r} is not one of {', '.join(KINDS)}")
    session.flush()
    if session.get_bind().dialect.name == "postgresql":
        session.execute(select(Job.id).where(Job.id == job_id).with_for_update())
    last = session.scalars(
        select(ProvenanceRecord).where(ProvenanceRecord.job_id == job_id)
        .order_by(ProvenanceRecord.seq.desc()).limit(1)
    ).one_or_none()
    seq, prev = (0, GENESIS) if last is None else (last.seq + 1, last.hash)
    row = ProvenanceRecord(**_record(job_id, seq, kind, attempt, time, data, prev))
    session.add(row)
    session.flush()
    return row


def start_chain(session: Session, job_id: str, kind: str, data: dict[str, Any], *, time: datetime) -> None:
    """The first record of a job whose row this same transaction inserted (and flushed): no other
    transaction can see the job yet and its chain is empty, so neither the row lock nor a read of the
    chain's head is needed, and one plain INSERT writes it."""
    if kind not in KINDS:
        raise ValueError(f"provenance kind {kind!r} is not one of {', '.join(KINDS)}")
    session.execute(insert(ProvenanceRecord), [_record(job_id, 0, kind, None, time, data, GENESIS)])


def _record(job_id: str, seq: int, kind: str, attempt: int | None, time: datetime | None, data: dict[str, Any],
            prev: str) -> dict[str, Any]:
    stamp = (time or utcnow()).isoformat()
    return dict(job_id=job_id, seq=seq, kind=kind, attempt=attempt, time=stamp, data=data, prev_hash=prev,
                hash=record_hash(job_id=job_id, seq=seq, kind=kind, attempt=attempt, time=stamp, data=data,
                                 prev_hash=prev))


def verify(session: Session, job_id: str) -> list[str]:
    """Problems found in the job's stored chain ([] when intact)."""
    rows = records(session, job_id)
    if not rows:
        return [f"job {job_id}: no provenance records (the submit record is missing)"]
    return verify_chain(as_dict(r) for r in rows)


def recorded(session: Session, job_id: str, kind: str, **match: Any) -> bool:
    """Whether a record of `kind` whose data holds every `match` item exists (dedupe before appending)."""
    for r in session.scalars(select(ProvenanceRecord).where(ProvenanceRecord.job_id == job_id,
                                                          ProvenanceRecord.kind == kind)):
        if all(r.data.get(k) == v for k, v in match.items()):
            return True
    return False
