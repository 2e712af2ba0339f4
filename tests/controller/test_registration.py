"""The reconciler registers a succeeded job's exported model (`spec.registerModel`) in MLflow (a real local
store, read back with MLflow's own client): once per job, linked back to the job, with the job's provenance
in the registered file; a job that exported nothing, or a registry that cannot be reached, is recorded on
the job and in its events while the job stays SUCCEEDED. The fake worker writes the export as
worker/export.py does (the real worker's path: test_e2e_registration.py)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy import select

from deepfleet.controller import provenance as prov
from deepfleet.controller.db import provenance as chain
from deepfleet.controller.db.models import Job
from deepfleet.controller.registry import MlflowRegistry, default_store, provenance_metadata, stamp
from tests.controller.reconcile_helpers import (
    database,
    drive,
    events,
    insert_job,
    job,
    job_document,
    reconciler,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning",
                                        "ignore::UserWarning")


def _doc(name: str, *args: str) -> dict:
    doc = job_document(name, args=["--steps", "2", *args], nodes=1, ckpt="ck")
    doc["spec"]["registerModel"] = {"name": "tiny-model"}
    return doc


def _registry(tmp_path: Path, tracking_uri: str | None = None) -> MlflowRegistry:
    return MlflowRegistry(tracking_uri=tracking_uri, store_dir=tmp_path / "mlflow", scratch_dir=tmp_path / "scratch")


def _register(rec, sessions, job_id: str, now: datetime, *, passes: int = 1) -> Job:
    for _ in range(passes):
        rec.reconcile_once(now)
    return job(sessions, job_id)


def test_a_succeeded_job_is_registered_once_and_links_back(tmp_path: Path) -> None:
    from mlflow import MlflowClient
    from safetensors import safe_open

    sessions = database(f"sqlite:///{tmp_path / 'db.sqlite'}")
    rec = reconciler(sessions, tmp_path, registry=_registry(tmp_path))
    job_id = insert_job(sessions, _doc("reg"))
    drive(rec, sessions, job_id, {"SUCCEEDED", "FAILED"})
    done = job(sessions, job_id)
    assert done.phase == "SUCCEEDED" and done.registration_state in ("pending", "registered")
    now = datetime.now(timezone.utc)
    done = _register(rec, sessions, job_id, now)
    assert done.phase == "SUCCEEDED" and done.registration_state == "registered", done.registration
    assert done.registration["version"] == "1" and done.registration["uri"] == "models:/tiny-model/1"
    assert "ModelRegistered" in events(sessions, job_id)

    with sessions() as s:
        records = [chain.as_dict(r) for r in chain.records(s, job_id)]
    assert prov.verify_chain(records) == [] and records[-1]["kind"] == "registration"
    registered_with = records[:-1]  # the chain as it stood when the file was stamped
    assert records[-1]["data"]["provenance_head"] == registered_with[-1]["hash"]
    assert records[-1]["data"]["version"] == "1" and records[-1]["data"]["checkpoint"] == "global_step2"

    store = default_store(tmp_path / "mlflow")
    client = MlflowClient(tracking_uri=store, registry_uri=store)
    [version] = client.search_model_versions("name = 'tiny-model'")
    assert version.tags["deepfleet.job_id"] == job_id
    assert version.tags["deepfleet.job_url"] == f"http://127.0.0.1:9/ui/#/jobs/{job_id}"
    assert version.tags["deepfleet.provenance_head"] == registered_with[-1]["hash"]
    assert job_id in version.description and "/ui/#/jobs/" in version.description
    local = client.download_artifacts(version.run_id, "model/model.safetensors", str(tmp_path / "back"))
    with safe_open(local, framework="pt") as f:
        meta = f.metadata()
        assert f.get_tensor("w").tolist() == [1.0, 2.0]  # the tensor bytes came through the stamp unchanged
    assert meta["deepfleet.provenance_head"] == registered_with[-1]["hash"]
    import json

    assert prov.verify_chain(json.loads(meta["deepfleet.provenance"])) == []

    # A crash after the registry answered but before the commit: the next try adopts version 1.
    with sessions() as s, s.begin():
        s.get(Job, job_id).registration_state = "pending"
    again = _register(rec, sessions, job_id, now)
    assert again.registration_state == "registered" and again.registration["version"] == "1"
    assert [str(v.version) for v in client.search_model_versions("name = 'tiny-model'")] == ["1"]
    with sessions() as s:
        assert [r.kind for r in chain.records(s, job_id)].count("registration") == 1


def test_a_job_that_exported_nothing_stays_succeeded_and_says_why(tmp_path: Path) -> None:
    sessions = database(f"sqlite:///{tmp_path / 'db.sqlite'}")
    rec = reconciler(sessions, tmp_path, registry=_registry(tmp_path))
    job_id = insert_job(sessions, _doc("noexp", "--no-export"))
    drive(rec, sessions, job_id, {"SUCCEEDED", "FAILED"})
    done = _register(rec, sessions, job_id, datetime.now(timezone.utc))
    assert done.phase == "SUCCEEDED" and done.registration_state == "failed"
    assert "export.json is missing" in done.registration["error"]
    assert events(sessions, job_id)[-1] == "RegistrationFailed" and done.claimed_by is None
    assert not (tmp_path / "mlflow").exists()  # nothing was sent to the registry


def test_an_unreachable_registry_is_retried_with_backoff_then_given_up(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    sessions = database(f"sqlite:///{tmp_path / 'db.sqlite'}")
    rec = reconciler(sessions, tmp_path, registry=_registry(tmp_path, "http://127.0.0.1:9"))
    job_id = insert_job(sessions, _doc("down"))
    drive(rec, sessions, job_id, {"SUCCEEDED", "FAILED"})  # its last pass made the first try
    first = job(sessions, job_id)
    assert first.registration_state == "pending" and first.registration["tries"] == 1
    t0 = datetime.fromisoformat(first.registration["retry_at"]) - timedelta(seconds=10)  # when it was made
    assert _register(rec, sessions, job_id, t0 + timedelta(seconds=9)).registration["tries"] == 1  # backing off
    for tries, wait in ((2, 10), (3, 30), (4, 70), (5, 150)):  # 10 s, doubling
        current = _register(rec, sessions, job_id, t0 + timedelta(seconds=wait))
        assert current.registration["tries"] == tries
    assert current.registration_state == "failed" and current.phase == "SUCCEEDED"
    assert "127.0.0.1:9" in current.registration["error"]
    kinds = events(sessions, job_id)
    assert kinds.count("RegistrationRetrying") == 4 and kinds[-1] == "RegistrationFailed"
    with sessions() as s:
        assert s.scalars(select(Job.claimed_by).where(Job.id == job_id)).one() is None


def test_the_stamped_metadata_is_the_exporters_and_only_the_header_changes(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    from deepfleet.engine.provenance import model_metadata

    records = [{"job_id": "j", "seq": 0, "kind": "submit", "attempt": None, "time": "t", "data": {"a": "é"},
                "prev_hash": prov.GENESIS}]
    records[0]["hash"] = prov.record_hash(**records[0])
    assert provenance_metadata("j", records) == model_metadata({"job_id": "j", "records": records})
    src, dst = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    tensors = {"x": torch.arange(7, dtype=torch.float16), "y": torch.ones(3, 5)}
    save_file(tensors, str(src), metadata={"format": "pt"})
    stamp(src, dst, provenance_metadata("j", records))
    back = load_file(str(dst))
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    link = tmp_path / "link.safetensors"
    link.symlink_to(src)
    with pytest.raises(ValueError, match="cannot open the exported model"):
        stamp(link, tmp_path / "c.safetensors", {})
