"""Admission: which PENDING jobs may start now. Pure; called once per pass by `controller.reconciler`.

Policy (in order):
1. **Order.** Jobs are ranked by effective priority (high > normal > low), then FIFO by submit time,
   then id. Effective priority is the job's priority raised one level per `aging_s` seconds of
   waiting (capped at high), so a flood of high-priority work cannot starve a low-priority job forever.
2. **Gang admission.** A job is admitted only when its whole demand (every node's processes and
   GPUs) fits at once, both in its queue's quota and in the backend's free capacity; never a part.
3. **Reservation for the head of line.** The first job in rank order that fits its quota but not the
   free capacity reserves that capacity: no job ranked after it may start on the shared pool until it
   has started, so a stream of small jobs cannot starve a large one (we have no run-time estimates,
   hence no backfill). A job blocked only by its queue's quota likewise blocks the rest of that queue
   (FIFO within the queue) and nothing else.
4. **Unschedulable.** A job whose demand exceeds its quota or the whole capacity can never start; it
   is reported with the reason (the reconciler fails it with that message) and reserves nothing.

Quotas are per queue (total processes and total GPUs of its admitted, unfinished jobs); `None` means
unlimited. Cost is O(n log n) in the queue length (one sort, one pass).

**A window of the queue.** The reconciler does not read every PENDING row each pass: within one base
priority, an older job never ranks below a younger one (aging only raises it), so each base priority is
a stream already in rank order, and `ranked_window` merges the first `n` of each into the first `n` of
the whole ranking, exactly. Admission then decides on that window; a job further back is decided once
the jobs ahead of it have moved (its demand cannot start before theirs anyway, under the reservation).
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime


class Priority(int, enum.Enum):
    """Job priority; larger runs first."""

    LOW = 0
    NORMAL = 1
    HIGH = 2

    @classmethod
    def parse(cls, value: str | int | Priority) -> Priority:
        if isinstance(value, str):
            return cls[value.upper()]
        return cls(value)


@dataclass(frozen=True)
class Demand:
    """Resources a job holds while admitted."""

    processes: int
    gpus: int = 0

    def __add__(self, other: Demand) -> Demand:
        return Demand(self.processes + other.processes, self.gpus + other.gpus)

    def __sub__(self, other: Demand) -> Demand:
        return Demand(self.processes - other.processes, self.gpus - other.gpus)


ZERO = Demand(0, 0)


@dataclass(frozen=True)
class Limit:
    """An upper bound on a Demand; `None` fields are unlimited."""

    processes: int | None = None
    gpus: int | None = None

    def allows(self, used: Demand) -> bool:
        """True when `used` stays within this limit."""
        return (self.processes is None or used.processes <= self.processes) and (
            self.gpus is None or used.gpus <= self.gpus
        )


UNLIMITED = Limit()


@dataclass(frozen=True)
class QueuedJob:
    """One PENDING job as admission sees it."""

    id: str
    queue: str
    priority: Priority
    demand: Demand
    submitted_at: datetime


@dataclass
class Admission:
    """The result of one pass: jobs to admit now (in rank order) and jobs that can never start."""

    admitted: list[str] = field(default_factory=list)
    unschedulable: dict[str, str] = field(default_factory=dict)
    reserved_for: str | None = None  # the head-of-line job holding the capacity reservation


def effective_priority(job: QueuedJob, *, now: datetime, aging_s: float) -> int:
    """The job's priority plus one level per `aging_s` seconds waited, capped at HIGH."""
    if aging_s <= 0:
        return int(job.priority)
    waited = max(0.0, (now - job.submitted_at).total_seconds())
    return min(int(Priority.HIGH), int(job.priority) + int(waited // aging_s))


def rank_key(job: QueuedJob, *, now: datetime, aging_s: float) -> tuple[int, datetime, str]:
    """Sort key of the admission order: effective priority (highest first), then submit time, then id."""
    return -effective_priority(job, now=now, aging_s=aging_s), job.submitted_at, job.id


def ranked_window(streams: Iterable[Iterable[QueuedJob]], n: int, *, now: datetime, aging_s: float) -> list[QueuedJob]:
    """The first `n` jobs of the admission order, from streams that each hold one base priority's jobs
    in (submit time, id) order and at least their first `n` (fewer only when the stream has no more)."""
    merged = heapq.merge(*streams, key=lambda j: rank_key(j, now=now, aging_s=aging_s))
    return list(itertools.islice(merged, n))


def admit(
    queued: Iterable[QueuedJob],
    *,
    used: Mapping[str, Demand],
    capacity: Limit,
    quotas: Mapping[str, Limit],
    now: datetime,
    aging_s: float = 600.0,
) -> Admission:
    """Decide which queued jobs start now. `used`: demand of admitted, unfinished jobs per queue;
    `capacity`: the backend's total; `quotas`: per queue (a missing queue is unlimited)."""
    ranked = sorted(queued, key=lambda j: rank_key(j, now=now, aging_s=aging_s))
    per_queue = dict(used)
    total = sum(per_queue.values(), ZERO)
    blocked_queues: set[str] = set()
    pool_reserved = False
    out = Admission()
    for job in ranked:
        quota = quotas.get(job.queue, UNLIMITED)
        if not quota.allows(job.demand):
            out.unschedulable[job.id] = (
                f"needs {job.demand.processes} processes / {job.demand.gpus} GPUs, more than queue "
                f"{job.queue!r} allows ({_fmt(quota)}); lower spec.nodes/processesPerNode or raise the quota"
            )
            continue
        if not capacity.allows(job.demand):
            out.unschedulable[job.id] = (
                f"needs {job.demand.processes} processes / {job.demand.gpus} GPUs, more than the backend "
                f"has ({_fmt(capacity)}); lower spec.nodes/processesPerNode"
            )
            continue
        if job.queue in blocked_queues or pool_reserved:
            continue
        queue_used = per_queue.get(job.queue, ZERO) + job.demand
        if not quota.allows(queue_used):
            blocked_queues.add(job.queue)  # FIFO within the queue: nothing later in it jumps ahead
            continue
        if not capacity.allows(total + job.demand):
            pool_reserved = True  # head-of-line reservation: the rest waits for this one
            out.reserved_for = job.id
            continue
        per_queue[job.queue] = queue_used
        total = total + job.demand
        out.admitted.append(job.id)
    return out


def _fmt(limit: Limit) -> str:
    p = "unlimited" if limit.processes is None else str(limit.processes)
    g = "unlimited" if limit.gpus is None else str(limit.gpus)
    return f"{p} processes / {g} GPUs"
