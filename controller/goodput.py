"""Goodput of a job: productive training time over the wall time since submit, and where the rest went.

A pure function of the job's record (`goodput(...)`), called by the API (`GET /v1/jobs/{id}/goodput`),
the CLI (`deepfleet get`, `deepfleet top`, through the API) and the `/metrics` gauges. Inputs are
the submit time, each attempt's backend times and the heartbeats (time, step, newest complete
checkpoint, cumulative checkpoint-save seconds of the attempt). Lost time, by cause:

    submit ── queueing ── attempt 1: [pending] [start-up] [training ......... ckpt ... failure]
                                                                          recomputation ┘
           ── restarts (backoff, teardown) ── attempt 2: [pending] [start-up] [training ...] ── end

- queueing: submit -> the first attempt's submission (admission), and every attempt's submission ->
  its start on the backend (pending for resources);
- start-up: an attempt's start -> its first heartbeat (processes, rendezvous, model build, resume);
- restarts: a failed attempt's end -> the next attempt's submission;
- recomputation: in an attempt followed by another, the time after its newest complete checkpoint
  (the whole training span when it completed none): the next attempt trains those steps again;
- checkpoint stalls: seconds spent saving checkpoints (the heartbeats' `checkpoint_s`), in the kept
  part of each attempt;
- (a job with no attempt yet has spent all its time queueing);
- other: what none of these explains (the time after the last attempt ends and before the job does).
Productive time is the rest of each attempt's training span. The causes and productive time add up to
the wall time exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

CAUSES = ("queueing", "start_up", "restarts", "recomputation", "checkpoint_stalls", "other")


@dataclass(frozen=True)
class AttemptTimes:
    number: int
    submitted_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None


@dataclass(frozen=True)
class Beat:
    attempt: int
    time: datetime
    step: int
    last_complete_checkpoint: str | None = None
    checkpoint_s: float | None = None
    """Seconds the attempt has spent saving checkpoints so far (cumulative)."""


@dataclass(frozen=True)
class Goodput:
    wall_s: float
    productive_s: float
    lost_s: dict[str, float] = field(default_factory=dict)

    @property
    def goodput(self) -> float | None:
        return self.productive_s / self.wall_s if self.wall_s > 0 else None


def _s(a: datetime | None, b: datetime | None) -> float:
    return max(0.0, (b - a).total_seconds()) if a is not None and b is not None else 0.0


def goodput(*, submitted_at: datetime, attempts: list[AttemptTimes], beats: list[Beat], now: datetime) -> Goodput:
    """The breakdown at `now` (the job's finish time once it has finished)."""
    lost = dict.fromkeys(CAUSES, 0.0)
    productive = 0.0
    ordered = sorted(attempts, key=lambda a: a.number)
    previous_end = submitted_at
    for i, a in enumerate(ordered):
        followed = i + 1 < len(ordered)
        if a.submitted_at is None:
            continue
        lost["restarts" if i else "queueing"] += _s(previous_end, a.submitted_at)
        end = a.finished_at or now
        lost["queueing"] += _s(a.submitted_at, a.started_at or (end if a.finished_at else now))
        previous_end = end
        if a.started_at is None:
            continue
        mine = sorted((b for b in beats if b.attempt == a.number), key=lambda b: b.time)
        if not mine:  # never trained: all of it was start-up
            lost["start_up"] += _s(a.started_at, end)
            continue
        first = mine[0].time
        lost["start_up"] += _s(a.started_at, first)
        kept_until = end
        if followed:  # the next attempt resumes from this attempt's newest checkpoint (if any)
            tag = mine[-1].last_complete_checkpoint
            saved = next((b.time for b in mine if tag and b.last_complete_checkpoint == tag), None)
            if saved is None or saved < first:
                saved = first
            kept_until = saved
            lost["recomputation"] += _s(saved, end)
        kept = [b for b in mine if b.time <= kept_until]
        stalls = max((b.checkpoint_s or 0.0 for b in kept), default=0.0)
        span = _s(first, kept_until)
        stalls = min(stalls, span)
        lost["checkpoint_stalls"] += stalls
        productive += span - stalls
    wall = _s(submitted_at, now)
    if not ordered:  # not admitted yet: all of it is queueing
        lost["queueing"] = wall
    lost["other"] = max(0.0, wall - productive - sum(v for k, v in lost.items() if k != "other"))
    return Goodput(wall_s=wall, productive_s=productive, lost_s=lost)


def eta_s(beats: list[Beat], *, max_steps: int | None) -> float | None:
    """Seconds to `max_steps` at the step rate between the newest two heartbeats of the newest attempt."""
    if not max_steps or len(beats) < 2:
        return None
    newest = max(b.attempt for b in beats)
    mine = sorted((b for b in beats if b.attempt == newest), key=lambda b: b.time)
    if len(mine) < 2:
        return None
    a, b = mine[-2], mine[-1]
    seconds = _s(a.time, b.time)
    if b.step <= a.step or seconds <= 0:
        return None
    return max(0, max_steps - b.step) * seconds / (b.step - a.step)
