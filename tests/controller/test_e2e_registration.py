"""End to end with the real `deepfleet-worker`: a small example-GPT job trained with DP-SGD (the model as
shipped, nothing frozen) that asks for `registerModel` succeeds; node 0 exports its newest checkpoint, the
controller registers it in its local MLflow store by itself, and MLflow's own client reads the entry back,
linked to the job, the file carrying the job's provenance chain. The job's record (API and `deepfleet get`)
and its step metrics carry the epsilon spent. Slow: one real controller and one real training job."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deepfleet.controller import provenance as prov
from deepfleet.controller.cli import app as cli_app
from tests.controller.conftest import ADMIN_TOKEN
from tests.controller.e2e_helpers import Controller, wait_phase
from tests.controller.jobspecs import checkpoint_dir, tiny_gpt_job

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning")]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 4


def dp_gpt_job(name: str) -> dict:
    dp = {"deepfleet_differential_privacy": {"enabled": True, "noise_multiplier": 1.0, "max_grad_norm": 1.0,
                                             "delta": 1e-5}}
    return tiny_gpt_job(name, steps=STEPS, engine=dp, checkpoint={"dir": "ck"}, registerModel={"name": "tiny-gpt"})


def wait_registration(client, job_id: str, *, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(job_id)
        if (job.get("registration") or {}).get("state") in ("registered", "failed"):
            return job
        time.sleep(0.2)
    raise AssertionError(f"registration still {client.get(job_id).get('registration')}: {client.events(job_id)}")


def test_a_dp_gpt_job_registers_its_model_in_mlflow_and_reports_epsilon(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow import MlflowClient
    from safetensors import safe_open

    from deepfleet.controller.registry import default_store

    data = tmp_path / "data"
    c = Controller(f"sqlite:///{tmp_path / 'db.sqlite'}", data, workdir=ROOT, heartbeat_interval=0.5)
    try:
        job = c.client.submit(json.dumps(dp_gpt_job("dp-reg")), content_type="application/json")
        done = wait_phase(c.client, job["id"], {"SUCCEEDED", "FAILED"}, timeout=240)
        assert done["phase"] == "SUCCEEDED", c.client.logs(job["id"], tail=40)
        done = wait_registration(c.client, job["id"])
        reg = done["registration"]
        assert reg["state"] == "registered", (reg, c.client.logs(job["id"], tail=20))
        assert (reg["registry"], reg["name"], reg["version"], reg["uri"]) == ("mlflow", "tiny-gpt", "1",
                                                                                "models:/tiny-gpt/1")

        privacy = done["privacy"]  # the job record carries epsilon, not only its last heartbeat
        assert privacy["delta"] == 1e-5 and privacy["accountant"] == "rdp" and privacy["epsilon"] > 0
        assert privacy["step"] == STEPS
        points = [p for p in c.client.metrics(job["id"]) if p["dp_epsilon"] is not None]
        assert points and points[-1]["dp_epsilon"] == privacy["epsilon"] and points[-1]["dp_delta"] == 1e-5
        assert [p["dp_epsilon"] for p in points] == sorted(p["dp_epsilon"] for p in points)  # epsilon only grows

        monkeypatch.setenv("DEEPFLEET_URL", c.url)
        monkeypatch.setenv("DEEPFLEET_API_TOKEN", ADMIN_TOKEN)
        shown = CliRunner().invoke(cli_app, ["get", job["id"]])
        assert shown.exit_code == 0, shown.output
        view = json.loads(shown.output)
        assert view["privacy"] == privacy and view["registration"]["uri"] == "models:/tiny-gpt/1"
        top = CliRunner().invoke(cli_app, ["top", "--all"])
        assert "EPSILON" in top.output and f"{privacy['epsilon']:.3g}" in top.output, top.output

        chain = c.client.provenance(job["id"])
        assert chain["verified"] and chain["records"][-1]["kind"] == "registration"
        registered = chain["records"][-1]["data"]
        assert registered["checkpoint"] == f"global_step{STEPS}"

        store = default_store(data / "mlflow")
        client = MlflowClient(tracking_uri=store, registry_uri=store)
        [version] = client.search_model_versions("name = 'tiny-gpt'")
        assert version.tags["deepfleet.job_id"] == job["id"]
        assert version.tags["deepfleet.job_url"] == f"{c.url}/ui/#/jobs/{job['id']}"
        assert version.tags["deepfleet.provenance_head"] == registered["provenance_head"]
        assert f"{c.url}/ui/#/jobs/{job['id']}" in version.description
        local = client.download_artifacts(version.run_id, "model/model.safetensors", str(tmp_path / "back"))
        exported = checkpoint_dir(data, job["id"], "ck") / "export" / "model.safetensors"
        with safe_open(local, framework="pt") as got, safe_open(str(exported), framework="pt") as worker:
            meta = got.metadata()
            assert sorted(got.keys()) == sorted(worker.keys()) and "gpt.pos.weight" in got.keys()
            for name in worker.keys():  # the registered tensors are the worker's export, byte for byte
                assert got.get_tensor(name).equal(worker.get_tensor(name)), name
            assert worker.metadata()["deepfleet.checkpoint"] == f"global_step{STEPS}"
        records = json.loads(meta["deepfleet.provenance"])
        assert meta["deepfleet.job_id"] == job["id"] and prov.verify_chain(records) == []
        assert records[-1]["hash"] == meta["deepfleet.provenance_head"] == registered["provenance_head"]
        assert [r["kind"] for r in records][:2] == ["submit", "attempt"]
    finally:
        c.client.close()  # an open keep-alive connection would hold up the server's graceful shutdown
        c.stop()
