"""The controller process's composition: one backend (and reconciler) per enabled backend, persisted
bootstrap token and secret."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from deepfleet.controller.backends.base import BackendError
from deepfleet.controller.scheduler import UNLIMITED, Limit
from deepfleet.controller.server import backends, build, persisted
from deepfleet.controller.settings import Settings
from tests.controller.conftest import TestClient

KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "http://127.0.0.1:9"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


def test_one_backend_per_enabled_name_with_its_capacity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "kubeconfig").write_text(KUBECONFIG)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("DEEPFLEET_K8S_NAMESPACE", "jobs")
    settings = Settings.from_env(data_dir=tmp_path, backends=["local", "kubernetes"])
    made = backends(settings, slots=3)
    assert [(b.name, cap) for b, cap in made] == [("local", Limit(processes=3)), ("kubernetes", UNLIMITED)]
    assert made[1][0].namespace == "jobs"


def test_an_unconfigured_azureml_backend_is_a_one_line_error(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    with warnings.catch_warnings():  # azure-ai-ml warns about its own marshmallow use at import
        warnings.simplefilter("ignore")
        import deepfleet.controller.backends.azureml  # noqa: F401
    for key in ("AZURE_SUBSCRIPTION_ID", "AZURE_RESOURCE_GROUP", "AZUREML_WORKSPACE"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(BackendError, match="azureml: set AZURE_SUBSCRIPTION_ID, AZURE_RESOURCE_GROUP"):
        backends(Settings(data_dir=tmp_path, backends=["azureml"]), slots=1)


def test_the_app_serves_the_web_page_and_has_a_reconciler_per_backend(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, backends=["local"], migrate_on_start=False)
    app = build(settings, slots=2)
    try:
        page = TestClient(app).get("/")  # no lifespan: the page needs no database
        assert page.status_code == 200 and "<title>deepfleet</title>" in page.text
        script = TestClient(app).get("/ui/app.js")
        assert script.headers["content-type"].startswith("text/javascript") and "/v1/jobs" in script.text
        assert TestClient(app).get("/ui/..%2Fweb.py").status_code == 404  # only the listed files are served
        assert [r.backend.name for r in app.state.reconcilers] == ["local"]
    finally:
        app.state.engine.dispose()


def test_persisted_values_survive_a_restart(tmp_path: Path) -> None:
    first = persisted(tmp_path, name="secret", make=lambda: "one")
    again = persisted(tmp_path, name="secret", make=lambda: "two")
    assert first == again == "one"
    assert (tmp_path / "secret").stat().st_mode & 0o777 == 0o600
