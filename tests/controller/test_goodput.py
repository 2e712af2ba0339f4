"""Goodput of a job with an injected restart equals the figure computed by hand; ETA from heartbeats."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from deepfleet.controller.goodput import AttemptTimes, Beat, eta_s, goodput

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def test_goodput_with_one_injected_restart_equals_the_hand_computed_figure() -> None:
    # submit at 0; attempt 1 submitted at 10 (queued 10 s), started at 15 (pending 5 s), first heartbeat
    # at 35 (start-up 20 s), checkpoint ckpt-100 complete by the heartbeat at 95, 4 s of checkpoint saving
    # before it, failure at 135; attempt 2 submitted at 165 (restart 30 s), started at 170 (pending 5 s),
    # first heartbeat at 190 (start-up 20 s), 6 s of saving, finished at 400; the job ends at 402.
    attempts = [AttemptTimes(1, at(10), at(15), at(135)), AttemptTimes(2, at(165), at(170), at(400))]
    beats = [
        Beat(1, at(35), 10), Beat(1, at(65), 50, None, 0.0), Beat(1, at(95), 100, "ckpt-100", 4.0),
        Beat(1, at(125), 140, "ckpt-100", 4.0),
        Beat(2, at(190), 110, "ckpt-100", 0.0), Beat(2, at(300), 250, "ckpt-200", 6.0), Beat(2, at(390), 400, None, 6.0),
    ]
    g = goodput(submitted_at=T0, attempts=attempts, beats=beats, now=at(402))
    # by hand: queueing 10 + 5 + 5 = 20; start-up 20 + 20 = 40; restarts 165 - 135 = 30;
    # recomputation 135 - 95 = 40 (after ckpt-100 in attempt 1); checkpoint stalls 4 + 6 = 10;
    # productive (95 - 35 - 4) + (400 - 190 - 6) = 56 + 204 = 260; other 402 - 400 = 2.
    assert g.lost_s == pytest.approx({"queueing": 20, "start_up": 40, "restarts": 30, "recomputation": 40,
                                      "checkpoint_stalls": 10, "other": 2})
    assert g.productive_s == pytest.approx(260) and g.wall_s == pytest.approx(402)
    assert g.goodput == pytest.approx(260 / 402)
    assert g.productive_s + sum(g.lost_s.values()) == pytest.approx(g.wall_s)


def test_an_attempt_without_a_checkpoint_is_all_recomputation_and_a_queued_job_all_queueing() -> None:
    attempts = [AttemptTimes(1, at(0), at(0), at(50)), AttemptTimes(2, at(60), at(60), None)]
    beats = [Beat(1, at(10), 5), Beat(1, at(40), 20), Beat(2, at(70), 5)]
    g = goodput(submitted_at=T0, attempts=attempts, beats=beats, now=at(100))
    assert g.lost_s["recomputation"] == pytest.approx(40) and g.productive_s == pytest.approx(30)
    assert g.lost_s["start_up"] == pytest.approx(20) and g.lost_s["restarts"] == pytest.approx(10)
    queued = goodput(submitted_at=T0, attempts=[], beats=[], now=at(30))
    assert queued.productive_s == 0 and queued.lost_s["queueing"] == pytest.approx(30)  # not yet admitted
    assert goodput(submitted_at=T0, attempts=[], beats=[], now=T0).goodput is None


def test_eta_from_the_newest_two_heartbeats() -> None:
    beats = [Beat(1, at(0), 10), Beat(2, at(100), 10), Beat(2, at(110), 30)]
    assert eta_s(beats, max_steps=130) == pytest.approx(50.0)
    assert eta_s(beats, max_steps=None) is None and eta_s(beats[:1], max_steps=10) is None
