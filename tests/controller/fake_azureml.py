"""A fake Azure Resource Manager for the Azure ML backend's tests: an azure-core transport that the real
`MLClient` sends its requests through (`MLClient(..., transport=FakeAzureML())`), plus a credential.

The SDK itself builds, serializes and parses everything (the command job, the anonymous environment,
the ARM URLs and api-versions); the fake stores jobs, answers GET/PUT/cancel like ARM does (404 with an
ARM error body for unknown jobs, 201 on create), lets a test move a job through Azure's statuses
(`set_status`) and inject error responses (`fail_next`), and records every request.
"""

from __future__ import annotations

import io
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import requests
from azure.core.credentials import AccessToken
from azure.core.pipeline._tools import is_rest
from azure.core.pipeline.transport import HttpTransport, RequestsTransportResponse
from azure.core.rest._requests_basic import RestRequestsTransportResponse

ARM = "https://management.azure.com"
SUBSCRIPTION = "00000000-0000-0000-0000-000000000000"


class FakeCredential:
    """A TokenCredential that never talks to Entra ID."""

    def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        return AccessToken("fake-token", int(time.time()) + 3600)


@dataclass
class Call:
    method: str
    path: str
    query: str
    body: Any
    authorization: str | None


@dataclass
class FakeAzureML(HttpTransport):
    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    faults: list[tuple[str, re.Pattern[str], int, dict[str, Any]]] = field(default_factory=list)

    # azure-core's transport protocol
    def __enter__(self) -> FakeAzureML:
        return self

    def __exit__(self, *args: Any) -> None:
        pass

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    # ------------------------------------------------------------------ test helpers
    def set_status(self, name: str, status: str, **properties: Any) -> None:
        self.jobs[name]["properties"]["status"] = status
        self.jobs[name]["properties"].setdefault("properties", {}).update(properties)

    def fail_next(self, method: str, path_pattern: str, status: int, *, code: str = "BadRequest",
                  message: str = "injected") -> None:
        self.faults.append((method, re.compile(path_pattern), status, {"error": {"code": code, "message": message}}))

    def job_puts(self) -> list[Call]:
        return [c for c in self.calls if c.method == "PUT" and re.search(r"/jobs/[^/]+$", c.path)]

    # ------------------------------------------------------------------ requests
    def _respond(self, request: Any, status: int, body: Any = None) -> Any:
        raw = requests.Response()
        raw.status_code = status
        raw.url = request.url
        raw.raw = io.BytesIO(json.dumps(body).encode() if body is not None else b"")
        raw.headers["Content-Type"] = "application/json"
        if is_rest(request):  # the SDK's newer generated clients read `response.json()`
            response = RestRequestsTransportResponse(request=request, internal_response=raw)
            response.read()
            return response
        return RequestsTransportResponse(request, raw)

    def send(self, request: Any, **kwargs: Any) -> Any:
        content = getattr(request, "content", None) or getattr(request, "body", None)
        body = json.loads(content) if content else None
        path, _, query = request.url.partition("?")
        path = path.removeprefix(ARM)
        self.calls.append(Call(request.method, path, query, body, request.headers.get("Authorization")))
        for i, (method, pattern, status, error) in enumerate(self.faults):
            if method == request.method and pattern.search(path):
                del self.faults[i]
                return self._respond(request, status, error)
        if m := re.search(r"/environments/([^/]+)/versions/([^/]+)$", path):
            return self._respond(request, 200, {"id": path, "name": m.group(2),
                                                "properties": (body or {}).get("properties", {})})
        if (m := re.search(r"/jobs/([^/]+)/cancel$", path)) and request.method == "POST":
            if m.group(1) not in self.jobs:
                return self._respond(request, 404, {"error": {"code": "UserError", "message": "job not found"}})
            self.set_status(m.group(1), "Canceled")
            return self._respond(request, 200)
        if m := re.search(r"/jobs/([^/]+)$", path):
            name = m.group(1)
            if request.method == "PUT":
                self.jobs[name] = {"id": path, "name": name, "type": "Microsoft.MachineLearningServices/workspaces/jobs",
                                   "properties": dict(body["properties"], status="NotStarted")}
                return self._respond(request, 201, self.jobs[name])
            if request.method == "GET" and name in self.jobs:
                return self._respond(request, 200, self.jobs[name])
            return self._respond(request, 404, {"error": {"code": "UserError",
                                                          "message": f"Could not find asset with name {name}"}})
        if re.search(r"/workspaces/[^/]+$", path) and request.method == "GET":
            return self._respond(request, 200, {"id": path, "name": path.rsplit("/", 1)[-1], "location": "westeurope",
                                                "properties": {"discoveryUrl": "https://westeurope.api.azureml.ms/discovery"}})
        return self._respond(request, 404, {"error": {"code": "NotFound", "message": f"no route {request.method} {path}"}})
