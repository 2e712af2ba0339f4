"""Table tests of admission: priority, FIFO, quotas, gang admission, reservation and aging."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from deepfleet.controller.scheduler import UNLIMITED, Demand, Limit, Priority, QueuedJob, admit

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def job(id: str, procs: int, *, prio: str = "normal", queue: str = "default", t: int = 0, gpus: int = 0) -> QueuedJob:
    return QueuedJob(id, queue, Priority.parse(prio), Demand(procs, gpus), T0 + timedelta(seconds=t))


@pytest.mark.parametrize(
    ("jobs", "capacity", "used", "quotas", "admitted", "reserved"),
    [
        # FIFO within a priority
        ([job("b", 1, t=2), job("a", 1, t=1)], Limit(2), {}, {}, ["a", "b"], None),
        # priority first
        ([job("lo", 1, prio="low", t=0), job("hi", 1, prio="high", t=5)], Limit(1), {}, {}, ["hi"], "lo"),
        # gang: a 4-process job is never partially admitted; it reserves, small later jobs wait
        ([job("big", 4, t=0), job("small", 1, t=1)], Limit(4), {"default": Demand(1)}, {}, [], "big"),
        # ... and a small job that came first is not blocked by a later big one
        ([job("small", 1, t=0), job("big", 4, t=1)], Limit(4), {}, {}, ["small"], "big"),
        # capacity already in use counts
        ([job("a", 2)], Limit(4), {"default": Demand(3)}, {}, [], "a"),
        # queue quota: blocks that queue only (FIFO within it), not other queues
        (
            [job("q1", 2, queue="a", t=0), job("q2", 1, queue="a", t=1), job("other", 2, queue="b", t=2)],
            Limit(8),
            {"a": Demand(2)},
            {"a": Limit(processes=3)},
            ["other"],
            None,
        ),
        # GPU quota
        ([job("g", 1, gpus=4), job("c", 1, t=1)], UNLIMITED, {}, {"default": Limit(gpus=8)}, ["g", "c"], None),
        ([job("g", 2, gpus=8)], UNLIMITED, {"default": Demand(1, 2)}, {"default": Limit(gpus=8)}, [], None),
    ],
)
def test_admission_table(jobs, capacity, used, quotas, admitted, reserved) -> None:
    out = admit(jobs, used=used, capacity=capacity, quotas=quotas, now=T0 + timedelta(seconds=10))
    assert out.admitted == admitted
    assert out.reserved_for == reserved


def test_never_fitting_jobs_are_reported_and_reserve_nothing() -> None:
    jobs = [job("huge", 16, t=0), job("over_quota", 4, queue="small", t=1), job("ok", 1, t=2)]
    out = admit(jobs, used={}, capacity=Limit(8), quotas={"small": Limit(processes=2)}, now=T0)
    assert out.admitted == ["ok"]
    assert set(out.unschedulable) == {"huge", "over_quota"}
    assert "more than the backend has (8 processes" in out.unschedulable["huge"]
    assert "queue 'small' allows" in out.unschedulable["over_quota"]


def test_aging_lifts_a_waiting_low_priority_job_over_fresh_high_priority_ones() -> None:
    old_low = job("old-low", 1, prio="low", t=0)
    fresh_high = job("fresh-high", 1, prio="high", t=1300)
    now = T0 + timedelta(seconds=1300)
    # waited 1300 s at aging 600 s: low + 2 levels = high; older -> first
    assert admit([fresh_high, old_low], used={}, capacity=Limit(1), quotas={}, now=now).admitted == ["old-low"]
    # no aging: priority wins
    out = admit([fresh_high, old_low], used={}, capacity=Limit(1), quotas={}, now=now, aging_s=0)
    assert out.admitted == ["fresh-high"]


def test_large_job_is_not_starved_by_a_stream_of_small_ones() -> None:
    # capacity 4; 3 in use; the big job (4) is first in line, small ones keep arriving
    queue = [job("big", 4, t=0)] + [job(f"s{i}", 1, t=i + 1) for i in range(20)]
    used = {"default": Demand(3)}
    out = admit(queue, used=used, capacity=Limit(4), quotas={}, now=T0)
    assert out.admitted == [] and out.reserved_for == "big"
    # once the running work finishes, the big job starts before any small one
    out = admit(queue, used={}, capacity=Limit(4), quotas={}, now=T0)
    assert out.admitted == ["big"]


def test_priority_parse_rejects_unknown() -> None:
    assert Priority.parse("HIGH") is Priority.HIGH
    with pytest.raises(KeyError):
        Priority.parse("urgent")


@pytest.mark.parametrize("seed", range(6))
def test_the_merged_window_is_the_head_of_the_whole_ranking(seed: int) -> None:
    import random

    from deepfleet.controller.scheduler import rank_key, ranked_window

    rng = random.Random(seed)
    now = T0 + timedelta(seconds=5000)
    jobs = [job(f"j{i:04d}", 1, prio=rng.choice(["low", "normal", "high"]), t=rng.randrange(0, 5000))
            for i in range(rng.randrange(50, 400))]
    whole = sorted(jobs, key=lambda j: rank_key(j, now=now, aging_s=900.0))
    for n in (1, 7, 40, len(jobs) + 5):
        streams = [sorted((j for j in jobs if j.priority is p), key=lambda j: (j.submitted_at, j.id))[:n]
                   for p in Priority]
        assert ranked_window(streams, n, now=now, aging_s=900.0) == whole[:n]
