"""The progress line: a plain script that configures no logging prints it on stdout every
`steps_per_print` steps (a subprocess, as a user runs it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("plain_script.py")


@pytest.mark.slow
def test_a_plain_script_prints_the_progress_line_without_logging_configured() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DEEPFLEET_STEP_SINKS", None)
    out = subprocess.run([sys.executable, str(SCRIPT), "6", "3"], capture_output=True, text=True, env=env,
                         timeout=120, check=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("[deepfleet] step ")]
    assert [line.split(" |")[0] for line in lines] == ["[deepfleet] step 3", "[deepfleet] step 6"], out
    assert "| loss " in lines[0] and "| lr 1.000e-02 |" in lines[0] and "samples/s" in lines[0]
    assert "step 3" not in out.stderr
