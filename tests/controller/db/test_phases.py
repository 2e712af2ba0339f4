"""The phase names the API filters and counts by are exactly the lifecycle's phases."""

from __future__ import annotations

from deepfleet.controller.db.models import JOB_PHASES, TERMINAL_PHASES
from deepfleet.controller.lifecycle import TERMINAL, Phase


def test_db_phases_mirror_the_lifecycle() -> None:
    assert JOB_PHASES == tuple(p.value for p in Phase)
    assert TERMINAL_PHASES == {p.value for p in TERMINAL}
