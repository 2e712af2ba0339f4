"""The worker reads an Azure ML job's secret references from Key Vault with the real `SecretClient`
through a fake vault (an azure-core transport answering like Key Vault: the bearer challenge first,
then the secret or a 404 error body): the values come back by variable name, the worker passes them to
its own environment, and a missing secret is one line naming the variable, without a value."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from typing import Any

import pytest
import requests
from azure.core.pipeline._tools import is_rest
from azure.core.pipeline.transport import HttpTransport, RequestsTransportResponse
from azure.core.rest._requests_basic import RestRequestsTransportResponse

from deepfleet.worker.keyvault import KeyVaultError, resolve_secrets
from deepfleet.worker.spec import KEYVAULT_SECRETS_ENV, KEYVAULT_URL_ENV
from tests.controller.fake_azureml import FakeCredential

VAULT = "https://df-vault.vault.azure.net"
CHALLENGE = 'Bearer authorization="https://login.microsoftonline.com/tenant-id", resource="https://vault.azure.net"'


class FakeVault(HttpTransport):
    """Key Vault's secrets GET: 401 with a challenge without a token, then the stored value or 404."""

    def __init__(self, secrets: dict[str, str]) -> None:
        self.secrets = secrets
        self.requests: list[tuple[str, str | None]] = []

    def __enter__(self) -> FakeVault:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    def _respond(self, request: Any, status: int, body: Any, headers: dict[str, str] | None = None) -> Any:
        raw = requests.Response()
        raw.status_code, raw.url = status, request.url
        raw.raw = io.BytesIO(json.dumps(body).encode())
        raw.headers.update({"Content-Type": "application/json", **(headers or {})})
        if is_rest(request):
            response = RestRequestsTransportResponse(request=request, internal_response=raw)
            response.read()
            return response
        return RequestsTransportResponse(request, raw)

    def send(self, request: Any, **kwargs: Any) -> Any:
        auth = request.headers.get("Authorization")
        self.requests.append((request.url, auth))
        if not auth:
            return self._respond(request, 401, {"error": {"code": "Unauthorized"}}, {"WWW-Authenticate": CHALLENGE})
        name = re.search(r"/secrets/([^/?]+)", request.url).group(1)
        if name not in self.secrets:
            return self._respond(request, 404, {"error": {"code": "SecretNotFound",
                                                          "message": f"A secret with (name/id) {name} was not found"}})
        return self._respond(request, 200, {"value": self.secrets[name], "id": f"{VAULT}/secrets/{name}/v1",
                                            "attributes": {"enabled": True}})


def _environ(refs: dict[str, str]) -> dict[str, str]:
    return {KEYVAULT_URL_ENV: VAULT, KEYVAULT_SECRETS_ENV: json.dumps(refs)}


def test_references_resolve_by_variable_name() -> None:
    vault = FakeVault({"hf-token": "hf_abc123", "wandb": "w-xyz"})
    out = resolve_secrets(_environ({"HF_TOKEN": "hf-token", "WANDB_API_KEY": "wandb"}), credential=FakeCredential(),
                          transport=vault)
    assert out == {"HF_TOKEN": "hf_abc123", "WANDB_API_KEY": "w-xyz"}
    assert vault.requests[-1][1] == "Bearer fake-token" and vault.requests[-1][0].startswith(f"{VAULT}/secrets/wandb")


def test_a_missing_secret_is_one_line_naming_the_variable() -> None:
    vault = FakeVault({"hf-token": "hf_abc123"})
    with pytest.raises(KeyVaultError) as err:
        resolve_secrets(_environ({"HF_TOKEN": "hf-token", "DB_PASSWORD": "db"}), credential=FakeCredential(),
                        transport=vault, retry_total=0)
    message = str(err.value)
    assert message.startswith("env DB_PASSWORD: cannot read secret 'db' from https://df-vault.vault.azure.net "
                              "(HTTP 404)") and "\n" not in message and "hf_abc123" not in message


def test_malformed_references_are_refused() -> None:
    with pytest.raises(KeyVaultError, match="not a JSON object"):
        resolve_secrets({KEYVAULT_URL_ENV: VAULT, KEYVAULT_SECRETS_ENV: "[1"})
    with pytest.raises(KeyVaultError, match=f"without {KEYVAULT_URL_ENV}"):
        resolve_secrets({KEYVAULT_SECRETS_ENV: "{}"})


def test_the_worker_exits_64_with_one_line_when_a_reference_cannot_be_read(tmp_path) -> None:
    spec = {"job_id": "j", "attempt": 0, "entrypoint": {"script": "x.py"}, "platform": "azureml"}
    env = {"PATH": "/usr/bin:/bin", "DEEPFLEET_WORKER_SPEC": json.dumps(spec),
           KEYVAULT_URL_ENV: VAULT, KEYVAULT_SECRETS_ENV: "not json"}
    done = subprocess.run([sys.executable, "-m", "deepfleet.worker.cli"], env=env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 64, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"deepfleet-worker: {KEYVAULT_SECRETS_ENV} is not a JSON object of variable -> secret name; resubmit the job"]
