"""worker/export.py's manifest when there is nothing to export, and `deepfleet-worker --export-dir`
(the export itself runs in the real-worker test tests/controller/test_e2e_registration.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from deepfleet.worker.export import export_model
from deepfleet.worker.spec import ExportManifest, parse_worker_spec


def _spec(ckpt: Path, **export: object):
    return parse_worker_spec({"job_id": "j1", "attempt": 2, "entrypoint": {"script": "train.py"},
                              "checkpoint": {"dir": str(ckpt)}, "export": {"dtype": "bf16", **export}})


def test_no_complete_checkpoint_is_a_manifest_error_not_a_crash(tmp_path: Path) -> None:
    (tmp_path / "ck" / "global_step4").mkdir(parents=True)  # incomplete: no COMPLETE marker
    manifest = export_model(_spec(tmp_path / "ck"))
    assert manifest is not None and manifest.file is None and "no complete checkpoint" in (manifest.error or "")
    written = ExportManifest.model_validate_json((tmp_path / "ck" / "export" / "export.json").read_text())
    assert written == manifest and (written.job_id, written.attempt) == ("j1", 2)
    assert not (tmp_path / "ck" / "export" / "model.safetensors").exists()
    elsewhere = export_model(_spec(tmp_path / "ck", dir=str(tmp_path / "out")))
    assert elsewhere is not None and (tmp_path / "out" / "export.json").exists()


def test_the_export_dir_flag_overrides_the_spec(tmp_path: Path) -> None:
    spec = _spec(tmp_path / "ck").model_dump(mode="json", exclude_none=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEEPFLEET_", "AZUREML_", "JOB_COMPLETION"))}
    proc = subprocess.run([sys.executable, "-m", "deepfleet.worker.cli", "--check", "--spec", json.dumps(spec),
                           "--export-dir", str(tmp_path / "mnt")], capture_output=True, text=True, timeout=60,
                          env={**env, "DEEPFLEET_NODE_RANK": "0", "DEEPFLEET_NNODES": "1",
                               "DEEPFLEET_MASTER_ADDR": "127.0.0.1"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith(f", exports the model to {tmp_path / 'mnt'}")
