"""A fake Azure Resource Manager for the Azure ML backend's tests: an azure-core transport that the real
`MLClient` sends its requests through (`MLClient(..., transport=FakeAzureML())`), plus a credential.

The SDK itself builds, serializes and parses everything (the command job, the anonymous environment,
the ARM URLs and api-versions); the fake stores jobs, answers GET/PUT/cancel like ARM does (404 with an
ARM error body for unknown jobs, 201 on create), lets a test move a job through Azure's statuses
(`set_status`) and inject error responses (`fail_next`), and records every request.

Model assets as ARM keeps them: a version PUT (`models/{name}/versions/{v}`) creates the model container on
first use; the container (`models/{name}`) answers its next version and 404 before any exists; listing a
name's versions answers a page, newest first (`$orderBy=createdtime desc`, `$top`), empty for an unknown
name (the SDK reads an empty page as "no such model").

Job logs take the path the SDK's own `jobs.stream` takes: the workspace's discovery document names the
run-history host, whose `runs/{name}/details` lists the run's log files as (SAS) URLs on a storage host,
which answer the text; `append_log` writes a node's `user_logs/std_log_process_<node>.txt` there.
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
HISTORY = "https://westeurope.api.azureml.ms"
BLOBS = "https://fakestore.blob.core.windows.net"
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
    logs: dict[str, dict[str, str]] = field(default_factory=dict)  # job name -> log file name -> text
    models: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # model name -> versions, oldest first

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

    def append_log(self, name: str, node: int, text: str) -> None:
        files = self.logs.setdefault(name, {})
        key = f"user_logs/std_log_process_{node}.txt"
        files[key] = files.get(key, "") + text

    def job_puts(self) -> list[Call]:
        return [c for c in self.calls if c.method == "PUT" and re.search(r"/jobs/[^/]+$", c.path)]

    def model_puts(self) -> list[Call]:
        return [c for c in self.calls if c.method == "PUT" and re.search(r"/models/[^/]+/versions/[^/]+$", c.path)]

    # ------------------------------------------------------------------ requests
    def _respond(self, request: Any, status: int, body: Any = None, *, text: str | None = None) -> Any:
        raw = requests.Response()
        raw.status_code = status
        raw.url = request.url
        if text is not None:
            raw.raw = io.BytesIO(text.encode())
            raw.headers["Content-Type"] = "text/plain; charset=utf-8"
        else:
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
        self.calls.append(Call(request.method, path.removeprefix(ARM), query, body, request.headers.get("Authorization")))
        if path.startswith((HISTORY, BLOBS)):
            return self._data_plane(request, path)
        path = path.removeprefix(ARM)
        for i, (method, pattern, status, error) in enumerate(self.faults):
            if method == request.method and pattern.search(path):
                del self.faults[i]
                return self._respond(request, status, error)
        if m := re.search(r"/environments/([^/]+)/versions/([^/]+)$", path):
            return self._respond(request, 200, {"id": path, "name": m.group(2),
                                                "properties": (body or {}).get("properties", {})})
        if m := re.search(r"/models/([^/]+)(/versions(?:/([^/]+))?)?$", path):
            return self._model(request, path, query, m.group(1), listing=bool(m.group(2)) and not m.group(3),
                               version=m.group(3), body=body)
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
                                                "properties": {"discoveryUrl": f"{HISTORY}/discovery"}})
        return self._respond(request, 404, {"error": {"code": "NotFound", "message": f"no route {request.method} {path}"}})

    def _model(self, request: Any, path: str, query: str, name: str, *, listing: bool, version: str | None,
               body: Any) -> Any:
        versions = self.models.get(name, [])
        if listing and request.method == "GET":
            params = dict(p.split("=", 1) for p in query.split("&") if "=" in p)
            page = list(reversed(versions)) if "desc" in params.get("$orderBy", "").lower() else list(versions)
            if params.get("listViewType", "ActiveOnly") == "ActiveOnly":
                page = [v for v in page if not v["properties"].get("isArchived")]
            top = int(params["$top"]) if params.get("$top", "").isdigit() else None
            return self._respond(request, 200, {"value": page[:top] if top else page})
        if version is None and request.method == "GET":
            if not versions:
                return self._respond(request, 404, {"error": {"code": "UserError",
                                                              "message": f"Could not find asset with name {name}"}})
            latest = versions[-1]["name"]
            nxt = str(int(latest) + 1) if latest.isdigit() else None
            return self._respond(request, 200, {"id": path, "name": name,
                                                "type": "Microsoft.MachineLearningServices/workspaces/models",
                                                "properties": {"latestVersion": latest, "nextVersion": nxt}})
        if version is not None and request.method == "PUT":
            found = next((v for v in versions if v["name"] == version), None)
            if found is not None and found["properties"].get("modelUri") != body["properties"].get("modelUri"):
                return self._respond(request, 409, {"error": {"code": "UserError", "message":
                                                              "Cannot update the path of an existing asset"}})
            stamp = f"2026-12-02T16:00:{len(versions):02d}.000000+00:00"
            item = {"id": path, "name": version, "type": "Microsoft.MachineLearningServices/workspaces/models/versions",
                    # The service fills flavors ({} for a custom model) and the provisioning state.
                    "properties": {"flavors": {}, **body["properties"], "provisioningState": "Succeeded"},
                    "systemData": {"createdAt": stamp, "lastModifiedAt": stamp}}
            if found is None:
                self.models.setdefault(name, []).append(item)
            else:
                versions[versions.index(found)] = item
            return self._respond(request, 201 if found is None else 200, item)
        if version is not None and request.method == "GET":
            found = next((v for v in versions if v["name"] == version), None)
            if found is not None:
                return self._respond(request, 200, found)
            return self._respond(request, 404, {"error": {"code": "UserError",
                                                          "message": f"Could not find asset {name}:{version}"}})
        return self._respond(request, 404, {"error": {"code": "NotFound", "message": f"no route {request.method} {path}"}})

    def _data_plane(self, request: Any, url: str) -> Any:
        if url == f"{HISTORY}/discovery":
            return self._respond(request, 200, {"api": HISTORY, "history": HISTORY, "catalog": HISTORY})
        if m := re.search(r"/history/v1\.0/.*/runs/([^/]+)/details$", url):
            name = m.group(1)
            if name not in self.jobs:
                return self._respond(request, 404, {"error": {"code": "UserError", "message": f"run {name} not found"}})
            files = {key: f"{BLOBS}/azureml/ExperimentRun/dcid.{name}/{key}?sv=2021&sig=fake"
                     for key in sorted(self.logs.get(name, {}))}
            return self._respond(request, 200, {"runId": name, "status": self.jobs[name]["properties"]["status"],
                                                "logFiles": files})
        if m := re.search(r"/dcid\.([^/]+)/(.+)$", url):
            text = self.logs.get(m.group(1), {}).get(m.group(2))
            if text is not None:
                return self._respond(request, 200, text=text)
        return self._respond(request, 404, {"error": {"code": "NotFound", "message": f"no route {url}"}})
