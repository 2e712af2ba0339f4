"""A thin HTTP client of the controller's REST API (`/v1/...`), on httpx.

Called by the CLI (`deepfleet submit/ls/get/logs/cancel/events/token/secret`) and the demo. It returns the
API's JSON as plain dicts and turns every non-2xx answer into `ApiError` carrying the server's
one-line `errors` (field paths and fixes), so callers print them and never a traceback. Never
imports the API, the database or a backend (import-linter checks it).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx


class ApiError(RuntimeError):
    """A non-2xx answer (or no answer) from the controller: `status` (0: unreachable), `detail`, `errors`."""

    def __init__(self, status: int, detail: str, errors: list[str] | None = None) -> None:
        self.status, self.detail, self.errors = status, detail, list(errors or [])
        super().__init__(f"{status}: {detail}" + "".join(f"\n  {e}" for e in self.errors))


class Client:
    """One controller at `url`, authenticated with a bearer `token` (an API token `dft_...`)."""

    def __init__(self, url: str, *, token: str | None = None, timeout: float = 30.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing
    def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise ApiError(0, f"cannot reach the controller at {self.url} ({e}); start it with "
                              "`deepfleet server` or pass --url") from None
        _raise_for(response)
        return response

    # ------------------------------------------------------------------ jobs
    def submit(self, document: str, *, content_type: str = "application/yaml") -> dict[str, Any]:
        """Submit a TrainingJob document (YAML text, or JSON with content_type application/json);
        returns the created job."""
        return self._request("POST", "/v1/jobs", content=document.encode(),
                             headers={"Content-Type": content_type}).json()

    def list_jobs(self, *, phase: str | None = None, label: list[str] | None = None, limit: int = 50,
                  project: str | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit}
        if phase:
            params["phase"] = phase
        if label:
            params["label"] = label
        if project:
            params["project"] = project
        return self._request("GET", "/v1/jobs", params=params).json()

    def get(self, job_id: str) -> dict[str, Any]:
        return self._request("GET", f"/v1/jobs/{job_id}").json()

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._request("POST", f"/v1/jobs/{job_id}/cancel").json()

    def events(self, job_id: str, *, after: int = 0) -> list[dict[str, Any]]:
        """All events after id `after`, oldest first (pages through the API)."""
        out: list[dict[str, Any]] = []
        while True:
            page = self._request("GET", f"/v1/jobs/{job_id}/events", params={"after": after}).json()
            out.extend(page["items"])
            if page.get("next_after") is None:
                return out
            after = page["next_after"]

    def goodput(self, job_id: str) -> dict[str, Any]:
        return self._request("GET", f"/v1/jobs/{job_id}/goodput").json()

    def provenance(self, job_id: str) -> dict[str, Any]:
        return self._request("GET", f"/v1/jobs/{job_id}/provenance").json()

    def metrics(self, job_id: str) -> list[dict[str, Any]]:
        return self._request("GET", f"/v1/jobs/{job_id}/metrics").json()["points"]

    def logs(self, job_id: str, *, node: int = 0, tail: int | None = None, attempt: int | None = None) -> str:
        params = _params(node=node, tail=tail, attempt=attempt)
        return self._request("GET", f"/v1/jobs/{job_id}/logs", params=params).text

    def follow_logs(self, job_id: str, *, node: int = 0, tail: int | None = None,
                    attempt: int | None = None) -> Iterator[str]:
        """Stream the log until the job finishes (the server ends the response)."""
        params = {**_params(node=node, tail=tail, attempt=attempt), "follow": "true"}
        try:
            with self._http.stream("GET", f"/v1/jobs/{job_id}/logs", params=params, timeout=None) as response:
                if response.is_error:
                    response.read()
                    _raise_for(response)
                yield from response.iter_text()
        except httpx.HTTPError as e:
            raise ApiError(0, f"log stream from {self.url} broke ({e})") from None

    # ------------------------------------------------------------------ tokens
    def create_token(self, name: str, *, role: str = "member", project: str | None = None,
                     expires_in_days: float | None = None) -> dict[str, Any]:
        body = {k: v for k, v in {"name": name, "role": role, "project": project,
                                  "expires_in_days": expires_in_days}.items() if v is not None}
        return self._request("POST", "/v1/tokens", json=body).json()

    # ------------------------------------------------------------------ secrets
    def set_secret(self, name: str, value: str) -> dict[str, Any]:
        """Create or replace a secret of the token's project (admin); returns its name and times."""
        return self._request("PUT", f"/v1/secrets/{name}", json={"value": value}).json()

    def list_secrets(self) -> list[dict[str, Any]]:
        return self._request("GET", "/v1/secrets").json()["items"]

    def delete_secret(self, name: str) -> None:
        self._request("DELETE", f"/v1/secrets/{name}")


def _params(**kw: Any) -> dict[str, Any]:
    return {k: v for k, v in kw.items() if v is not None}


def _raise_for(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = {"detail": response.text[:500] or response.reason_phrase}
    detail = body.get("detail") if isinstance(body, dict) else None
    errors = body.get("errors") if isinstance(body, dict) else None
    raise ApiError(response.status_code, str(detail or response.reason_phrase), errors if isinstance(errors, list) else None)
