"""Secrets of an Azure ML job, read from Azure Key Vault by the worker before training starts.

Called by `worker/cli.py` when `DEEPFLEET_KEYVAULT_SECRETS` is set (the Azure ML backend sets it for
`env: {VAR: {secret: name}}` entries, with `DEEPFLEET_KEYVAULT_URL`): each named secret is read with
the official `azure-keyvault-secrets` client under `DefaultAzureCredential` (on Azure ML compute: the
job's managed identity) and returned by variable name; the caller puts them into the worker's own
environment, which the training processes inherit. Values are never printed; an error names the
variable, the secret and the fix. The SDKs are imported here only (extra `deepfleet[keyvault]`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from deepfleet.worker.spec import KEYVAULT_SECRETS_ENV, KEYVAULT_URL_ENV


class KeyVaultError(RuntimeError):
    """A reference that cannot be resolved (one line naming the variable and the fix)."""


def resolve_secrets(environ: Mapping[str, str], *, credential: Any = None, **client_kwargs: Any) -> dict[str, str]:
    """{VAR: value} for the references in `environ`; `client_kwargs` go to azure-core (`transport=`)."""
    try:
        refs = json.loads(environ[KEYVAULT_SECRETS_ENV])
        assert isinstance(refs, dict)
    except (ValueError, AssertionError):
        raise KeyVaultError(f"{KEYVAULT_SECRETS_ENV} is not a JSON object of variable -> secret name; "
                            "resubmit the job") from None
    url = environ.get(KEYVAULT_URL_ENV)
    if not url:
        raise KeyVaultError(f"{KEYVAULT_SECRETS_ENV} is set without {KEYVAULT_URL_ENV}; resubmit the job")
    try:
        from azure.core.exceptions import AzureError
        from azure.keyvault.secrets import SecretClient
    except ImportError:
        raise KeyVaultError("reading Key Vault secrets needs azure-keyvault-secrets and azure-identity in the "
                            "worker image; install deepfleet[keyvault]") from None
    if credential is None:
        from azure.identity import DefaultAzureCredential

        credential = DefaultAzureCredential()
    client = SecretClient(vault_url=url, credential=credential, **client_kwargs)
    out = {}
    for var, name in refs.items():
        try:
            value = client.get_secret(name).value
        except AzureError as e:
            status = getattr(e, "status_code", None)
            raise KeyVaultError(f"env {var}: cannot read secret {name!r} from {url}"
                                f"{f' (HTTP {status})' if status else ''}; check that it exists and that the "
                                "job's managed identity may read secrets of that vault") from None
        if value is None:
            raise KeyVaultError(f"env {var}: secret {name!r} in {url} has no value; set one")
        out[var] = value
    return out
