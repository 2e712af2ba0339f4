"""worker/signals.py: SIGTERM and the notice file set the local flag, the grace period runs on an
injected clock, and at a step boundary every rank agrees when any one of them was notified."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from deepfleet.worker.signals import MARKER_ENV, PreemptionWatcher, exit_preempted, mark_preempted
from deepfleet.worker.spec import PreemptionSpec
from tests.spawn import spawn


def test_sigterm_sets_the_flag_and_starts_the_grace_period() -> None:
    now = [10.0]
    previous = signal.getsignal(signal.SIGTERM)
    with PreemptionWatcher(PreemptionSpec(grace_period_s=30), clock=lambda: now[0]) as w:
        assert not w.noticed and w.remaining_s() == 30
        os.kill(os.getpid(), signal.SIGTERM)
        assert w.noticed and w.reason == "signal SIGTERM"
        now[0] += 12
        assert w.remaining_s() == 18
        assert w.should_stop()  # no process group: the local flag decides
    assert signal.getsignal(signal.SIGTERM) == previous


def test_notice_file_is_a_notice(tmp_path: Path) -> None:
    notice = tmp_path / "preempt"
    w = PreemptionWatcher(PreemptionSpec(notice_file=str(notice)))
    assert not w.should_stop()
    notice.write_text("spot interruption in 120s")
    assert w.should_stop() and w.reason == f"notice file {notice}"


def test_marker_and_exit_code(tmp_path: Path) -> None:
    marker = tmp_path / "m"
    mark_preempted("global_step7", environ={MARKER_ENV: str(marker)})
    assert marker.read_text() == "global_step7"
    mark_preempted("x", environ={})  # without the agent: nothing to tell
    with pytest.raises(SystemExit) as e:
        exit_preempted()
    assert e.value.code == 75


def _agree(rank: int, world_size: int) -> list[bool]:
    w = PreemptionWatcher()
    decisions = []
    for step in range(3):
        if rank == world_size - 1 and step == 1:
            w.notice("test")
        decisions.append(w.should_stop())
    return decisions


@pytest.mark.slow
def test_ranks_agree_when_any_rank_was_notified() -> None:
    assert spawn(_agree, 2, timeout=120) == [[False, True, True], [False, True, True]]
