"""Table tests of the job lifecycle: the transition table and the pure decide()."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from deepfleet.controller.backends.base import Observation, RunPhase
from deepfleet.controller.lifecycle import (
    TRANSITIONS,
    IllegalTransition,
    JobState,
    Kind,
    Phase,
    backoff,
    check_transition,
    decide,
    is_terminal,
)
from deepfleet.worker.spec import FailureClass, classify_exit

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)
RUNNING = JobState(phase=Phase.RUNNING, attempt=0, submitted=True, max_restarts=2, backoff_seconds=5)


def failed(code: int) -> Observation:
    return Observation(RunPhase.FAILED, exit_codes={0: code}, failure_class=classify_exit(code))


def test_terminal_phases_have_no_way_out() -> None:
    for phase in Phase:
        assert is_terminal(phase) == (TRANSITIONS[phase] == frozenset())
    assert {p for p in Phase if p.is_terminal()} == {Phase.SUCCEEDED, Phase.FAILED, Phase.CANCELLED}


@pytest.mark.parametrize(
    ("src", "dst", "ok"),
    [
        (Phase.PENDING, Phase.ADMITTED, True),
        (Phase.PENDING, Phase.RUNNING, False),
        (Phase.ADMITTED, Phase.RUNNING, True),
        (Phase.RUNNING, Phase.RESTARTING, True),
        (Phase.RESTARTING, Phase.RUNNING, True),
        (Phase.RUNNING, Phase.ADMITTED, False),
        (Phase.SUCCEEDED, Phase.RUNNING, False),
        (Phase.CANCELLED, Phase.PENDING, False),
    ],
)
def test_transition_table(src: Phase, dst: Phase, ok: bool) -> None:
    if ok:
        check_transition(src, dst)
    else:
        with pytest.raises(IllegalTransition, match=f"{src.value} -> {dst.value}"):
            check_transition(src, dst)


@pytest.mark.parametrize(
    ("job", "observed", "kind", "phase"),
    [
        # admission is not decide()'s business
        (JobState(Phase.PENDING), None, Kind.NOTHING, None),
        (JobState(Phase.PENDING, cancel_requested=True), None, Kind.CANCEL, Phase.CANCELLED),
        # first submit, then observe
        (JobState(Phase.ADMITTED), None, Kind.SUBMIT, None),
        (JobState(Phase.ADMITTED, submitted=True), None, Kind.NOTHING, None),
        (JobState(Phase.ADMITTED, submitted=True), Observation(RunPhase.PENDING), Kind.NOTHING, None),
        (JobState(Phase.ADMITTED, submitted=True), Observation(RunPhase.RUNNING), Kind.MARK, Phase.RUNNING),
        (JobState(Phase.ADMITTED, submitted=True), Observation(RunPhase.SUCCEEDED), Kind.MARK, Phase.SUCCEEDED),
        # crash after recording the submit intent, before the backend got it: resubmit (same name)
        (JobState(Phase.ADMITTED, submitted=True), Observation(RunPhase.NOT_FOUND), Kind.SUBMIT, None),
        (RUNNING, Observation(RunPhase.RUNNING), Kind.NOTHING, None),
        (RUNNING, Observation(RunPhase.SUCCEEDED), Kind.MARK, Phase.SUCCEEDED),
        # seen running, then gone: a lost attempt
        (RUNNING, Observation(RunPhase.NOT_FOUND), Kind.RESTART, Phase.RESTARTING),
        (replace(RUNNING, cancel_requested=True), Observation(RunPhase.RUNNING), Kind.CANCEL, Phase.CANCELLED),
        # the failure ladder
        (RUNNING, failed(64), Kind.FAIL, Phase.FAILED),
        (RUNNING, failed(65), Kind.FAIL, Phase.FAILED),
        (replace(RUNNING, retry_user_errors=True), failed(65), Kind.RESTART, Phase.RESTARTING),
        (RUNNING, failed(75), Kind.RESTART, Phase.RESTARTING),
        (RUNNING, failed(76), Kind.RESTART, Phase.RESTARTING),
        (RUNNING, failed(77), Kind.FAIL, Phase.FAILED),
        (RUNNING, failed(137), Kind.RESTART, Phase.RESTARTING),
        (RUNNING, failed(143), Kind.RESTART, Phase.RESTARTING),
        # budget spent: retryable classes fail, preemption still restarts
        (replace(RUNNING, restarts=2), failed(76), Kind.FAIL, Phase.FAILED),
        (replace(RUNNING, restarts=2), failed(137), Kind.FAIL, Phase.FAILED),
        (replace(RUNNING, restarts=2), failed(75), Kind.RESTART, Phase.RESTARTING),
        # terminal: nothing, whatever the backend says
        (JobState(Phase.SUCCEEDED, submitted=True), failed(137), Kind.NOTHING, None),
        (JobState(Phase.CANCELLED, cancel_requested=True), None, Kind.NOTHING, None),
    ],
)
def test_decide_table(job: JobState, observed: Observation | None, kind: Kind, phase: Phase | None) -> None:
    action = decide(job, observed, NOW)
    assert (action.kind, action.phase) == (kind, phase)
    if phase is not None:
        check_transition(job.phase, phase)


@pytest.mark.parametrize(("code", "counts"), [(75, False), (76, True), (137, True)])
def test_preemption_does_not_count_against_the_budget(code: int, counts: bool) -> None:
    assert decide(RUNNING, failed(code), NOW).counts is counts


def test_oom_event_says_what_to_change() -> None:
    action = decide(RUNNING, failed(77), NOW)
    assert action.reason == "OutOfMemory"
    assert "train_micro_batch_size_per_gpu" in action.message and "activation checkpointing" in action.message


def test_restart_waits_for_exponential_backoff_and_names_the_checkpoint() -> None:
    job = replace(RUNNING, restarts=1, last_checkpoint="global_step20")
    action = decide(job, failed(137), NOW)
    assert action.not_before == NOW + timedelta(seconds=10)  # 5 s * 2**1
    assert "resuming from global_step20" in action.message
    restarting = JobState(Phase.RESTARTING, attempt=1, restarts=2, not_before=action.not_before,
                          last_checkpoint="global_step20")
    assert decide(restarting, None, NOW + timedelta(seconds=9)).kind is Kind.NOTHING
    submit = decide(restarting, None, NOW + timedelta(seconds=10))
    assert submit.kind is Kind.SUBMIT and "resuming from global_step20" in submit.message
    # the new attempt is observed running
    assert decide(replace(restarting, submitted=True), Observation(RunPhase.RUNNING), NOW).phase is Phase.RUNNING


def test_backoff_is_capped() -> None:
    assert backoff(JobState(Phase.RUNNING, restarts=40, backoff_seconds=5)) == timedelta(seconds=600)
    assert backoff(JobState(Phase.RUNNING, restarts=0, backoff_seconds=0)) == timedelta(0)


def test_unknown_failure_class_is_retried_within_budget() -> None:
    obs = Observation(RunPhase.FAILED, exit_codes={}, failure_class=None, message="lost")
    assert decide(RUNNING, obs, NOW).kind is Kind.RESTART
    assert FailureClass.UNKNOWN.value == "unknown"


@pytest.mark.parametrize(
    ("silent_s", "kind"),
    [(None, Kind.NOTHING), (59, Kind.NOTHING), (61, Kind.RESTART)],
)
def test_a_running_attempt_that_falls_silent_is_restarted_as_hung(silent_s: int | None, kind: Kind) -> None:
    last = None if silent_s is None else NOW - timedelta(seconds=silent_s)
    job = replace(RUNNING, last_heartbeat_at=last, hang_after=timedelta(seconds=60))
    action = decide(job, Observation(RunPhase.RUNNING), NOW)
    assert action.kind is kind
    if kind is Kind.RESTART:
        assert action.counts and "no heartbeat for 61s (limit 60s); presumed hung" in action.message
    assert decide(replace(job, hang_after=None), Observation(RunPhase.RUNNING), NOW).kind is Kind.NOTHING
