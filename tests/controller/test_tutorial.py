"""docs/first-job.md stays true: its train.py, ds_config.json and job.yaml are taken from the page;
the spec validates with the controller's model, and the script trains (one process, as by hand)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from deepfleet.controller.spec import parse_job_yaml

PAGE = Path(__file__).resolve().parents[2] / "docs" / "first-job.md"


def _block(lang: str, first_line: str) -> str:
    for body in re.findall(rf"```{lang}\n(.*?)```", PAGE.read_text(), re.S):
        if body.startswith(first_line):
            return body
    raise AssertionError(f"no {lang} block starting {first_line!r} in {PAGE}")


@pytest.mark.slow
def test_the_tutorials_files_validate_and_its_script_trains(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(_block("python", "# train.py"))
    (tmp_path / "ds_config.json").write_text(_block("json", "{"))
    json.loads((tmp_path / "ds_config.json").read_text())
    spec = parse_job_yaml(_block("yaml", "# job.yaml"), base_dir=tmp_path)
    assert spec.spec.max_steps == 300 and spec.spec.entrypoint.script == "train.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DEEPFLEET_MAX_STEPS": "3",
           "DEEPFLEET_CHECKPOINT_DIR": str(tmp_path / "ck")}
    proc = subprocess.run([sys.executable, "train.py", "--config", "ds_config.json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "ck" / "latest").read_text().strip() == "global_step3"
