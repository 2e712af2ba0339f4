"""A job's provenance chain on PostgreSQL: the submit record holds the spec and the normalized engine
config with their hashes, each attempt its code identity, heartbeats add torch's version, datasets and
checkpoint lineage; a restart appends without changing earlier records; an edited or removed row is
detected; `deepfleet provenance` prints it; an exported model's metadata matches its job."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from deepfleet.controller import cli_jobs
from deepfleet.controller import provenance as prov
from deepfleet.controller.cli import app as cli_app
from deepfleet.controller.client import Client
from deepfleet.controller.db.models import Attempt, Job
from deepfleet.controller.reconciler import append_attempt_record
from tests.controller.api.helpers import token
from tests.controller.conftest import ADMIN_TOKEN
from tests.controller.jobspecs import job_document

HEADERS = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
ENGINE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
CODE_DIR = Path(__file__).parent  # where the job's script (fake_worker.py) lives


def _submit(client) -> str:
    doc = job_document("prov", args=["--steps", "2"])
    doc["metadata"]["project"] = "research"
    doc["spec"]["engine"] = ENGINE
    r = client.post("/v1/jobs", json=doc, headers=HEADERS)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _start_attempt(app, job_id: str, number: int) -> None:
    with app.state.sessions() as s:
        job = s.get(Job, job_id)
        job.current_attempt = number
        attempt = Attempt(job_id=job_id, number=number, backend="local", run_name=f"df-prov-a{number}",
                          phase="PENDING", nodes=2, exit_codes={})
        s.add(attempt)
        append_attempt_record(s, job, attempt, prov_time(), workdir=str(CODE_DIR))
        s.commit()


def prov_time():
    from deepfleet.controller.db.models import utcnow

    return utcnow()


def _beat(client, job_id: str, **fields) -> None:
    r = client.post(f"/v1/jobs/{job_id}/heartbeat", json=fields, headers=HEADERS)
    assert r.status_code == 200, r.text


def _chain(client, job_id: str) -> dict:
    r = client.get(f"/v1/jobs/{job_id}/provenance", headers=HEADERS)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture()
def ran_twice(app, client) -> str:
    """A job submitted, run as attempt 0 (dataset, checkpoint at step 2), restarted as attempt 1."""
    job_id = _submit(client)
    _start_attempt(app, job_id, 0)
    data = [{"uri": "s3://bucket/train.jsonl", "digest": "sha256:" + "ab" * 32}]
    _beat(client, job_id, step=1, torch_version="2.13.0+cpu", datasets=data)
    _beat(client, job_id, step=2, torch_version="2.13.0+cpu", datasets=data, last_complete_checkpoint="global_step2")
    return job_id


def test_every_field_is_recorded_and_a_restart_only_appends(app, client, ran_twice: str) -> None:
    job_id = ran_twice
    before = _chain(client, job_id)
    assert before["verified"] and before["problems"] == []
    assert [r["kind"] for r in before["records"]] == ["submit", "attempt", "runtime", "dataset", "checkpoint"]
    submit, attempt, runtime, dataset, ckpt = (r["data"] for r in before["records"])
    with app.state.sessions() as s:
        stored_spec = s.get(Job, job_id).spec
    assert submit["spec"] == stored_spec and submit["spec_sha256"] == prov.sha256_json(stored_spec)
    assert submit["engine_config"]["train_batch_size"] == 4  # normalized: 2 per rank x 2 ranks x 1
    assert submit["engine_config_sha256"] == prov.sha256_json(submit["engine_config"])
    assert submit["deepfleet_version"] == prov.deepfleet_version() and submit["submitted_by"].startswith("token:")
    script = CODE_DIR / "fake_worker.py"
    head = subprocess.run(["git", "-C", str(CODE_DIR), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert attempt["code"]["file_sha256"] == "sha256:" + hashlib.sha256(script.read_bytes()).hexdigest()
    assert attempt["code"]["git_commit"] == head and attempt["resumed_from"] is None
    assert attempt["run_name"] == "df-prov-a0" and attempt["deepfleet_version"] == prov.deepfleet_version()
    assert runtime == {"attempt": 0, "torch_version": "2.13.0+cpu"}
    assert dataset == {"attempt": 0, "uri": "s3://bucket/train.jsonl", "digest": "sha256:" + "ab" * 32}
    assert ckpt == {"attempt": 0, "tag": "global_step2", "step": 2}

    _start_attempt(app, job_id, 1)  # the restart
    _beat(client, job_id, step=4, torch_version="2.13.0+cpu", last_complete_checkpoint="global_step4")
    after = _chain(client, job_id)
    assert after["verified"]
    assert after["records"][:5] == before["records"]  # earlier records unchanged
    new = after["records"][5:]
    assert [(r["kind"], r["attempt"]) for r in new] == [("attempt", 1), ("runtime", 1), ("checkpoint", 1)]
    assert new[0]["data"]["resumed_from"] == {"attempt": 0, "tag": "global_step2", "step": 2}
    assert new[2]["data"] == {"attempt": 1, "tag": "global_step4", "step": 4}
    assert new[0]["prev_hash"] == before["head"]


def test_an_edited_or_removed_row_is_detected(app, client, ran_twice: str) -> None:
    job_id = ran_twice
    with app.state.engine.begin() as conn:
        conn.execute(text("UPDATE provenance_records SET data = CAST(:d AS JSON) WHERE job_id = :j AND kind = 'dataset'"),
                     {"d": json.dumps({"attempt": 0, "uri": "s3://other", "digest": "sha256:" + "cd" * 32}),
                      "j": job_id})
    chain = _chain(client, job_id)
    assert not chain["verified"]
    assert chain["problems"] == ["record 3 (dataset): content does not match its hash (modified)"]
    with app.state.engine.begin() as conn:
        conn.execute(text("DELETE FROM provenance_records WHERE job_id = :j AND seq = 3"), {"j": job_id})
    problems = _chain(client, job_id)["problems"]
    assert any("expected sequence number 3" in p for p in problems)
    assert any("prev_hash does not match" in p for p in problems)


def test_members_see_only_their_projects_provenance(app, client, ran_twice: str) -> None:
    assert client.get(f"/v1/jobs/{ran_twice}/provenance", headers=token(app, project="research", role="member")
                      ).json()["verified"]
    other = token(app, project="elsewhere", role="member")
    assert client.get(f"/v1/jobs/{ran_twice}/provenance", headers=other).status_code == 404
    assert client.get(f"/v1/jobs/{ran_twice}/provenance").status_code == 401


def test_cli_prints_the_chain_and_fails_on_tampering(app, client, ran_twice: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    class InProcess(Client):  # the CLI's client, speaking to the app through the test client
        def __init__(self) -> None:
            self.url, self._http = "http://testserver", client

        def close(self) -> None:
            pass

    client.headers.update(HEADERS)
    monkeypatch.setattr(cli_jobs, "_client", lambda url, token: InProcess())
    runner = CliRunner()
    result = runner.invoke(cli_app, ["provenance", ran_twice])
    assert result.exit_code == 0, result.output
    assert "verified" in result.output and "global_step2" in result.output and "torch 2.13.0+cpu" in result.output
    with app.state.engine.begin() as conn:
        conn.execute(text("UPDATE provenance_records SET attempt = 7 WHERE job_id = :j AND seq = 1"), {"j": ran_twice})
    result = runner.invoke(cli_app, ["provenance", ran_twice])
    assert result.exit_code == 1 and "TAMPERED: record 1 (attempt)" in result.output


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_an_exported_model_carries_its_jobs_provenance(client, ran_twice: str, tmp_path: Path) -> None:
    import torch
    from safetensors import safe_open

    from deepfleet.engine.checkpoint.cli import app as ckpt_app
    from deepfleet.engine.checkpoint.io import StepWriter

    writer = StepWriter()
    fields = dict(global_steps=2, micro_steps=2, world_size=1, zero_stage=0, config_hash=None,
                  deepfleet_version="test", torch_version=torch.__version__)
    writer.save(tmp_path / "ckpt" / "global_step2", tensors={"model": {"w": torch.arange(6.0).view(2, 3)}},
                rank_state={"rank": 0}, shared_state={"global_steps": 2}, manifest_fields=fields)
    writer.close()
    chain = _chain(client, ran_twice)
    (tmp_path / "prov.json").write_text(json.dumps(chain))
    out = tmp_path / "model.safetensors"
    result = CliRunner().invoke(ckpt_app, ["export", str(tmp_path / "ckpt"), "--out", str(out),
                                           "--provenance", str(tmp_path / "prov.json")])
    assert result.exit_code == 0, result.output
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
        assert torch.equal(f.get_tensor("w"), torch.arange(6.0).view(2, 3))
    assert meta["deepfleet.job_id"] == ran_twice and meta["deepfleet.provenance_head"] == chain["head"]
    records = json.loads(meta["deepfleet.provenance"])
    assert records == chain["records"] and prov.verify_chain(records) == []
