"""The import-linter contracts in pyproject.toml: they hold on the tree, and each one bites: adding one
forbidden import to a scratch copy of the tree makes that contract fail (a module added to the engine
is forbidden to the controller without being listed anywhere).

import-linter needs the mapped `deepfleet.*` packages on disk as a real tree (an editable install maps
them virtually), so every check lints one throwaway non-editable install of this checkout, built
once per module; that install is also the scratch copy the forbidden imports are written into.
lint-imports runs from the repo root, where the `forbidden_matching` contract type lives
(tests/arch/contract_types.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
BINDIR = Path(sys.executable).parent


def _contracts() -> dict[str, dict]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {c["id"]: c for c in data["tool"]["importlinter"]["contracts"]}


@dataclass(frozen=True)
class Site:
    """A non-editable install of the tree (`root/deepfleet/...`) and a grimp cache beside it."""

    root: Path
    cache: Path

    def lint(self, *contract_ids: str) -> subprocess.CompletedProcess:
        lint = shutil.which("lint-imports", path=str(BINDIR))
        assert lint, "import-linter is part of the dev extra"
        args = [lint, "--cache-dir", str(self.cache), str(ROOT / "pyproject.toml")]
        for contract in contract_ids:
            args += ["--contract", contract]
        return subprocess.run(
            args, cwd=ROOT, capture_output=True, text=True, timeout=240,
            env={"PATH": str(BINDIR), "PYTHONPATH": str(self.root), "HOME": os.environ.get("HOME", "/tmp")},
        )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Site:
    base = tmp_path_factory.mktemp("lint")
    target = base / "site"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(ROOT)],
        capture_output=True, text=True, timeout=240, cwd=base,
    )
    assert build.returncode == 0, build.stderr
    return Site(root=target, cache=base / "cache")


def test_import_linter_contracts_hold(site: Site) -> None:
    proc = site.lint()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


# --------------------------------------------------------------------------- each contract bites

# (contract id, file in the tree, a line appended to it that breaks that contract); a file that does
# not exist is created for the case and removed after it.
CASES: list[tuple[str, str, str]] = [
    ("kernels-standalone", "kernels/rope.py", "import deepfleet.engine.optim"),
    ("engine-below-worker", "engine/optim.py", "import deepfleet.worker.heartbeat"),
    ("worker-below-controller", "worker/heartbeat.py", "import deepfleet.controller.client"),
    # indirect: controller.spec -> engine.config -> engine.config_base -> torch
    ("controller-torch-free", "engine/config_base.py", "import torch"),
    ("controller-schema-only", "controller/reconciler.py", "import deepfleet.engine.memory"),
    ("controller-schema-only", "controller/cli.py", "from deepfleet.engine import initialize"),
    # indirect, through an allowed module
    ("controller-schema-only", "engine/config_zero.py", "import deepfleet.engine.precision"),
    # a module nobody listed: engine/brand_new.py, created by the case below
    ("controller-schema-only", "engine/brand_new.py", '"""A module added after the contract was written."""'),
    ("schema-leaves", "worker/spec.py", "import sqlalchemy"),
    ("schema-leaves", "engine/config_noops.py", "import fastapi"),
    ("schema-leaves", "engine/config_compression.py", "import torch"),
    ("triton-only-in-kernels-triton", "engine/optim.py", "import triton"),
    ("triton-only-in-kernels-triton", "kernels/rope.py", "from deepfleet.kernels._triton import rope"),
    ("controller-layers", "controller/spec.py", "import deepfleet.controller.db.models"),
    ("api-records-intent", "controller/api/jobs.py", "import deepfleet.controller.backends.local"),
    ("cli-client-over-http", "controller/client.py", "import deepfleet.controller.db.session"),
    ("backends-independent", "controller/backends/local.py", "import deepfleet.controller.backends.azureml"),
]
# Files a case needs besides its own (case index -> (file, line)).
COMPANIONS = {7: ("controller/compile.py", "import deepfleet.engine.brand_new")}
assert CASES[7][1] == "engine/brand_new.py"


def test_every_contract_has_a_violation_case() -> None:
    assert {contract for contract, _, _ in CASES} == set(_contracts())


# Runs in one lint-imports process (its start-up dominates a single check): for each case, append the
# lines to the files in the scratch tree, check that one contract, put the files back.
_DRIVER = """
import contextlib, io, json, sys
from pathlib import Path
import importlinter.api  # configures import-linter (readers, graph builder)
from importlinter.application.use_cases import lint_imports
config, root, cases = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
results = []
for contract, edits in cases:
    saved = {}
    for rel, line in edits:
        path = root / "deepfleet" / rel
        saved[path] = path.read_text() if path.exists() else None
        path.write_text((saved[path] or "") + "\\n" + line + "  # injected by the test\\n")
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            kept = lint_imports(config_filename=config, limit_to_contracts=(contract,), cache_dir=None, no_logo=True)
    finally:
        for path, text in saved.items():
            path.unlink() if text is None else path.write_text(text)
    results.append([kept, out.getvalue()])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def broken(site: Site) -> list[tuple[bool, str]]:
    """Per case: (kept?, lint-imports report) with that case's violation injected."""
    cases = [(contract, [(rel, line), *([COMPANIONS[i]] if i in COMPANIONS else [])])
             for i, (contract, rel, line) in enumerate(CASES)]
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(ROOT / "pyproject.toml"), str(site.root), json.dumps(cases)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
        env={"PATH": str(BINDIR), "PYTHONPATH": str(site.root), "HOME": os.environ.get("HOME", "/tmp")},
    )
    assert proc.returncode == 0, proc.stderr
    return [(kept, report) for kept, report in json.loads(proc.stdout.splitlines()[-1])]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c}:{r}" for c, r, _ in CASES])
def test_a_forbidden_import_breaks_the_contract(broken: list[tuple[bool, str]], case: int) -> None:
    kept, report = broken[case]
    assert not kept, report
    assert "1 broken" in report and "BROKEN" in report, report
