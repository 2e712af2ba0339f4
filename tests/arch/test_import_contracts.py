"""The import-linter contracts in pyproject.toml: they hold on the tree, their generated module lists
match the files on disk, and each one bites: adding one forbidden import to a scratch copy of the
tree makes exactly that contract fail.

import-linter needs the mapped `deepfleet.*` packages on disk as a real tree (an editable install maps
them virtually), so every check lints one throwaway non-editable install of this checkout, built
once per module; that install is also the scratch copy the forbidden imports are written into.
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
            args, cwd=self.root, capture_output=True, text=True, timeout=240,
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


# --------------------------------------------------------------------------- lists vs the tree


def _children(package: str) -> set[str]:
    """Dotted names of the modules and subpackages directly inside a mapped folder."""
    folder = ROOT / package
    out = {f"deepfleet.{package}.{p.stem}" for p in folder.glob("*.py") if p.name != "__init__.py"}
    out |= {f"deepfleet.{package}.{d.name}" for d in folder.iterdir() if (d / "__init__.py").exists()}
    return out


def _schema_modules() -> set[str]:
    return {f"deepfleet.engine.{p.stem}" for p in (ROOT / "engine").glob("config*.py")} | {"deepfleet.worker.spec"}


def test_controller_allow_list_names_every_other_engine_and_worker_module() -> None:
    listed = set(_contracts()["controller-schema-only"]["forbidden_modules"])
    expected = (_children("engine") | _children("worker")) - _schema_modules()
    assert expected - listed == set(), f"add to controller-schema-only forbidden_modules: {sorted(expected - listed)}"
    assert listed - expected == set(), f"not on disk (or allowed), remove: {sorted(listed - expected)}"


def test_schema_leaves_list_is_every_config_module_and_worker_spec() -> None:
    listed = set(_contracts()["schema-leaves"]["source_modules"])
    assert listed == _schema_modules(), f"schema-leaves source_modules should be {sorted(_schema_modules())}"


def test_triton_contract_covers_every_module_outside_kernels_triton() -> None:
    listed = set(_contracts()["triton-only-in-kernels-triton"]["source_modules"])
    tops = {f"deepfleet.{d}" for d in ("engine", "worker", "controller", "migrations")}
    expected = tops | (_children("kernels") - {"deepfleet.kernels._triton"})
    assert listed == expected, f"missing: {sorted(expected - listed)}; stale: {sorted(listed - expected)}"


# --------------------------------------------------------------------------- each contract bites

# contract id -> (file in the tree, a line that breaks exactly that contract)
VIOLATIONS: dict[str, tuple[str, str]] = {
    "kernels-standalone": ("kernels/rope.py", "import deepfleet.engine.optim"),
    "engine-below-worker": ("engine/optim.py", "import deepfleet.worker.heartbeat"),
    "worker-below-controller": ("worker/heartbeat.py", "import deepfleet.controller.client"),
    # indirect: controller.spec -> engine.config -> engine.config_base -> torch
    "controller-torch-free": ("engine/config_base.py", "import torch"),
    "controller-schema-only": ("controller/reconciler.py", "import deepfleet.engine.memory"),
    "controller-not-engine-init": ("controller/cli.py", "from deepfleet.engine import initialize"),
    "schema-leaves": ("worker/spec.py", "import sqlalchemy"),
    "triton-only-in-kernels-triton": ("engine/optim.py", "import triton"),
    "controller-layers": ("controller/spec.py", "import deepfleet.controller.db.models"),
    "api-records-intent": ("controller/api/jobs.py", "import deepfleet.controller.backends.local"),
    "cli-client-over-http": ("controller/client.py", "import deepfleet.controller.db.session"),
    "backends-independent": ("controller/backends/local.py", "import deepfleet.controller.backends.azureml"),
}


def test_every_contract_has_a_violation_case() -> None:
    assert set(VIOLATIONS) == set(_contracts())


# Runs in one lint-imports process (its start-up dominates a single check): for each case, append the
# line to the file in the scratch tree, check that one contract, put the file back.
_DRIVER = """
import contextlib, io, json, sys
from pathlib import Path
import importlinter.api  # noqa: F401 - configures import-linter (readers, graph builder)
from importlinter.application.use_cases import lint_imports
config, root, cases = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
results = {}
for contract, (rel, line) in cases.items():
    path = root / "deepfleet" / rel
    original = path.read_text()
    path.write_text(original + "\\n" + line + "  # injected by the test\\n")
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            kept = lint_imports(config_filename=config, limit_to_contracts=(contract,), cache_dir=None, no_logo=True)
    finally:
        path.write_text(original)
    results[contract] = [kept, out.getvalue()]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def broken(site: Site) -> dict[str, tuple[bool, str]]:
    """Contract id -> (kept?, lint-imports report) with that contract's violation injected."""
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(ROOT / "pyproject.toml"), str(site.root), json.dumps(VIOLATIONS)],
        cwd=site.root, capture_output=True, text=True, timeout=240,
        env={"PATH": str(BINDIR), "PYTHONPATH": str(site.root), "HOME": os.environ.get("HOME", "/tmp")},
    )
    assert proc.returncode == 0, proc.stderr
    return {k: (v[0], v[1]) for k, v in json.loads(proc.stdout.splitlines()[-1]).items()}


@pytest.mark.parametrize("contract", sorted(VIOLATIONS))
def test_a_forbidden_import_breaks_the_contract(broken: dict[str, tuple[bool, str]], contract: str) -> None:
    kept, report = broken[contract]
    rel, _ = VIOLATIONS[contract]
    assert not kept, report
    assert "1 broken" in report and rel.replace("/", ".").removesuffix(".py") in report, report
