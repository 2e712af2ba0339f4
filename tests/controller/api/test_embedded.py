"""The embedded default (SQLite under the data dir, migrated at start) serves the API; /readyz reports
an unreachable database as 503 while /healthz and /metrics keep answering."""

from __future__ import annotations

from pathlib import Path

from deepfleet.controller.app import create_app
from deepfleet.controller.settings import Settings
from tests.controller.api.helpers import job_yaml, yaml_headers
from tests.controller.conftest import ADMIN_TOKEN, TestClient

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def test_sqlite_default_end_to_end(tmp_path: Path) -> None:
    settings = Settings.from_env({"HOME": str(tmp_path)}, admin_token=ADMIN_TOKEN, admin_project="research")
    with TestClient(create_app(settings)) as client:
        r = client.post("/v1/jobs", content=job_yaml(), headers=yaml_headers(ADMIN))
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        assert client.post(f"/v1/jobs/{job_id}/cancel", headers=ADMIN).status_code == 202
        listed = client.get("/v1/jobs?label=team=nlp", headers=ADMIN).json()
        assert [j["id"] for j in listed["items"]] == [job_id]
        assert client.get("/readyz").status_code == 200
    assert (tmp_path / ".local/share/deepfleet/deepfleet.db").exists()


def test_readyz_is_503_when_the_database_is_down(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, database_url="postgresql+psycopg://postgres@127.0.0.1:1/none",
                        migrate_on_start=False)
    app = create_app(settings)
    with TestClient(app) as client:
        r = client.get("/readyz")
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
        assert client.get("/healthz").status_code == 200
        assert client.get("/metrics").status_code == 200
