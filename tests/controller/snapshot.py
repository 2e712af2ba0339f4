"""Snapshot files for public surfaces (the JobSpec JSON schema, the OpenAPI document).

Used by the controller tests. A test compares a freshly generated document with the committed file
under `tests/controller/snapshots/`; run with `DEEPFLEET_UPDATE_SNAPSHOTS=1` to rewrite the file
after an intended change, then review the diff.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

SNAPSHOTS = Path(__file__).parent / "snapshots"


def assert_matches_snapshot(document: Any, name: str) -> None:
    """Fail with a pointer to the update switch when `document` differs from snapshots/<name>."""
    path = SNAPSHOTS / name
    text = json.dumps(document, indent=2, sort_keys=True) + "\n"
    if os.environ.get("DEEPFLEET_UPDATE_SNAPSHOTS") == "1":
        path.write_text(text)
        return
    assert path.exists(), f"{path} missing; run with DEEPFLEET_UPDATE_SNAPSHOTS=1 to create it"
    assert json.loads(path.read_text()) == document, (
        f"{name} changed; if intended, rerun with DEEPFLEET_UPDATE_SNAPSHOTS=1 and commit the new snapshot"
    )
