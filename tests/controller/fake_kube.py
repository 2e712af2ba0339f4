"""An in-process fake of the Kubernetes API server for the Kubernetes backend's tests.

No API server can be installed here, and patching the client's methods would test nothing of what the
backend sends (URLs, query parameters, bodies, kubeconfig loading, watch streams, error statuses). So
this is a small HTTP server on 127.0.0.1 that the *real* `kubernetes` client talks to, with the
behaviour the backend relies on:

* pods, services, secrets (core/v1) and jobs (batch/v1) in known namespaces: create (409 AlreadyExists, 422
  Invalid for a bad name/label, 404 for an unknown namespace), get (404), list with label selectors
  (`=`, `==`, `!=`, `in`, `notin`, `key`, `!key`), delete with `propagationPolicy` from the query or
  the DeleteOptions body; Orphan / Background / Foreground garbage collection through
  ownerReferences, and batch/v1 Job's default of **Orphan** (pods stay, as on a real API server);
* secrets as stored by the API server: write-only `stringData` merged into `data` as base64 (a
  `stringData` key wins), `data` values must be base64 and keys `[-._a-zA-Z0-9]+`, `type` defaults to
  Opaque, and the name is a DNS-1123 subdomain;
* watch with a global resourceVersion: replay after an RV, ADDED for the current state without one,
  `compact()` makes older RVs answer with an ERROR event carrying Status 410 Expired;
* a minimal Indexed-Job controller: creating an unsuspended Job creates `parallelism` pods with
  hostname `<job>-<i>`, the Job's `subdomain`, `JOB_COMPLETION_INDEX` and the completion-index label;
  `set_pod_phase` plays the kubelet and the Job's status and conditions follow (Complete when every
  index succeeded; Failed with BackoffLimitExceeded past backoffLimit, deleting the other pods);
* pod logs (`pod_logs[name]`, `append_pod_log`; `follow` streams until the container terminates), `fail_next(...)` to inject error statuses, and every request recorded.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import yaml

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
ROUTE = re.compile(r"^/(?:api/v1|apis/(?P<group>batch|networking\.k8s\.io)/v1)/namespaces/(?P<ns>[^/]+)"
                   r"/(?P<kind>pods|services|secrets|jobs|networkpolicies)(?:/(?P<name>[^/]+))?(?:/(?P<sub>log|status))?$")
KINDS = {"pods": ("v1", "Pod"), "services": ("v1", "Service"), "secrets": ("v1", "Secret"), "jobs": ("batch/v1", "Job"),
         "networkpolicies": ("networking.k8s.io/v1", "NetworkPolicy")}
GROUP_OF = {"jobs": "batch", "networkpolicies": "networking.k8s.io"}
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]  # lower-case names
    body: Any


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


def selector_matches(selector: str | None, labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics for the forms the client sends."""
    if not selector:
        return True
    for term in re.split(r",(?![^()]*\))", selector):
        term = term.strip()
        if m := re.match(r"^([^\s!=]+)\s+(in|notin)\s+\((.*)\)$", term):
            values = {v.strip() for v in m.group(3).split(",")}
            present = m.group(1) in labels and labels[m.group(1)] in values
            if present != (m.group(2) == "in"):
                return False
        elif "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k) != v:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


@dataclass
class FakeKubeAPI:
    """The fake API server; `start()` it, point a kubeconfig at it with `kubeconfig(path)`."""

    namespaces: set[str] = field(default_factory=lambda: {"default", "kube-system"})
    objects: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)  # (kind, ns, name)
    events: list[tuple[int, str, str, dict[str, Any]]] = field(default_factory=list)  # (rv, kind, type, obj)
    requests: list[Recorded] = field(default_factory=list)
    pod_logs: dict[str, str] = field(default_factory=dict)
    run_job_controller: bool = True

    def __post_init__(self) -> None:
        self.rv = 1000
        self.compacted_rv = 0
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self._faults: list[tuple[str, re.Pattern[str], int, int]] = []  # method, path, status, times
        self._server: ThreadingHTTPServer | None = None
        self._epoch = 0  # bumped by compact() and stop(): open watch streams end

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> FakeKubeAPI:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                fake._handle(self)

            do_POST = do_DELETE = do_PUT = do_PATCH = do_GET

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True, name="fake-kube").start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            with self.changed:
                self._epoch += 1
                self.changed.notify_all()
            self._server.shutdown()
            self._server.server_close()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def kubeconfig(self, path: Path) -> str:
        """Write a kubeconfig for this server; returns its path."""
        doc = {"apiVersion": "v1", "kind": "Config", "current-context": "fake",
               "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
               "users": [{"name": "fake", "user": {"token": "fake-token"}}],
               "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "default"}}]}
        path.write_text(yaml.safe_dump(doc))
        return str(path)

    # ------------------------------------------------------------------ test helpers
    def fail_next(self, method: str, path_pattern: str, status: int, *, times: int = 1) -> None:
        """The next `times` requests matching `method` and the regex `path_pattern` (searched in the path
        with its query string) get `status`."""
        self._faults.append((method, re.compile(path_pattern), status, times))

    def compact(self) -> None:
        """Forget the event history and end the open watches (as an API server restart would): clients
        that reconnect from an older resourceVersion get 410 Expired."""
        with self.lock:
            self.compacted_rv = self.rv
            self.events.clear()
            self._epoch += 1
            self.changed.notify_all()

    def get(self, kind: str, ns: str, name: str) -> dict[str, Any] | None:
        with self.lock:
            obj = self.objects.get((kind, ns, name))
            return copy.deepcopy(obj) if obj else None

    def list(self, kind: str, ns: str, selector: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [copy.deepcopy(o) for (k, n, _), o in sorted(self.objects.items())
                    if k == kind and n == ns and selector_matches(selector, o["metadata"].get("labels", {}))]

    def calls(self, method: str, path_contains: str = "") -> list[Recorded]:
        return [r for r in self.requests if r.method == method and path_contains in r.path]

    def set_pod_phase(self, ns: str, name: str, phase: str, *, exit_code: int | None = None,
                      reason: str | None = None) -> None:
        """Play the kubelet: move a pod to Running/Succeeded/Failed (terminated with `exit_code`/`reason`)."""
        with self.lock:
            pod = self.objects[("pods", ns, name)]
            status = pod.setdefault("status", {})
            status["phase"] = phase
            container = pod["spec"]["containers"][0]["name"]
            if phase == "Running":
                state: dict[str, Any] = {"running": {"startedAt": _now()}}
            elif phase in ("Succeeded", "Failed"):
                code = exit_code if exit_code is not None else (0 if phase == "Succeeded" else 1)
                term = {"exitCode": code, "reason": reason or ("Completed" if code == 0 else "Error"),
                        "startedAt": _now(), "finishedAt": _now()}
                state = {"terminated": term}
            else:
                state = {"waiting": {"reason": "ContainerCreating"}}
            status["containerStatuses"] = [{"name": container, "state": state, "ready": phase == "Running",
                                            "restartCount": 0, "image": "x", "imageID": "", "started": phase == "Running"}]
            self._bump("pods", "MODIFIED", pod)
            owner = self._controller_of(pod)
            if owner is not None:
                self._sync_job(owner)

    def set_all_pods(self, ns: str, job: str, phase: str) -> None:
        for pod in self.list("pods", ns, f"job-name={job}"):
            self.set_pod_phase(ns, pod["metadata"]["name"], phase)

    # ------------------------------------------------------------------ store
    def _bump(self, kind: str, event: str, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.events.append((self.rv, kind, event, copy.deepcopy(obj)))
        self.changed.notify_all()

    def _add(self, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        meta.setdefault("labels", {})
        api_version, kind_name = KINDS[kind]
        obj["apiVersion"], obj["kind"] = api_version, kind_name
        self.objects[(kind, meta["namespace"], meta["name"])] = obj
        self._bump(kind, "ADDED", obj)
        return obj

    def _remove(self, kind: str, ns: str, name: str, policy: str) -> None:
        obj = self.objects.pop((kind, ns, name))
        self._bump(kind, "DELETED", obj)
        uid = obj["metadata"]["uid"]
        for (k, n, nm), dep in list(self.objects.items()):
            refs = dep["metadata"].get("ownerReferences", [])
            if n != ns or not any(r["uid"] == uid for r in refs):
                continue
            if policy == "Orphan":
                dep["metadata"]["ownerReferences"] = [r for r in refs if r["uid"] != uid]
                self._bump(k, "MODIFIED", dep)
            else:  # Background and Foreground both end with the dependents gone
                self._remove(k, n, nm, policy)

    def _controller_of(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        for ref in obj["metadata"].get("ownerReferences", []):
            if ref.get("controller") and ref["kind"] == "Job":
                job = self.objects.get(("jobs", obj["metadata"]["namespace"], ref["name"]))
                if job is not None and job["metadata"]["uid"] == ref["uid"]:
                    return job
        return None

    # ------------------------------------------------------------------ the Job controller
    def _start_job(self, job: dict[str, Any]) -> None:
        spec, meta = job["spec"], job["metadata"]
        uid = meta["uid"]
        spec.setdefault("selector", {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}})
        tmpl_labels = spec["template"].setdefault("metadata", {}).setdefault("labels", {})
        tmpl_labels.update({"batch.kubernetes.io/controller-uid": uid, "controller-uid": uid,
                            "batch.kubernetes.io/job-name": meta["name"], "job-name": meta["name"]})
        job["status"] = {"active": 0, "succeeded": 0, "failed": 0, "ready": 0}
        if not self.run_job_controller or spec.get("suspend"):
            return
        for index in range(spec.get("parallelism", 1)):
            template = copy.deepcopy(spec["template"])
            pod_spec = template["spec"]
            for c in pod_spec["containers"]:
                c.setdefault("env", []).append({"name": "JOB_COMPLETION_INDEX", "value": str(index)})
            if spec.get("completionMode") == "Indexed":
                pod_spec["hostname"] = f"{meta['name']}-{index}"
            labels = dict(template["metadata"].get("labels", {}), **{INDEX_LABEL: str(index)})
            pod = {"metadata": {"name": f"{meta['name']}-{index}-{uuid.uuid4().hex[:5]}", "namespace": meta["namespace"],
                                "labels": labels, "annotations": {INDEX_LABEL: str(index)},
                                "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"],
                                                     "uid": uid, "controller": True, "blockOwnerDeletion": True}]},
                   "spec": pod_spec, "status": {"phase": "Pending"}}
            self._add("pods", pod)
        job["status"]["active"] = spec.get("parallelism", 1)

    def _sync_job(self, job: dict[str, Any]) -> None:
        ns, uid = job["metadata"]["namespace"], job["metadata"]["uid"]
        pods = [p for (k, n, _), p in self.objects.items() if k == "pods" and n == ns
                and any(r["uid"] == uid for r in p["metadata"].get("ownerReferences", []))]
        phases = [p.get("status", {}).get("phase") for p in pods]
        status = job.setdefault("status", {})
        status.update(active=sum(ph in ("Pending", "Running") for ph in phases),
                      ready=phases.count("Running"), succeeded=phases.count("Succeeded"),
                      failed=phases.count("Failed"))
        conditions = status.setdefault("conditions", [])
        done = {c["type"] for c in conditions}
        if "Failed" not in done and "Complete" not in done:
            if status["failed"] > job["spec"].get("backoffLimit", 6):
                for kind in ("FailureTarget", "Failed"):
                    conditions.append({"type": kind, "status": "True", "reason": "BackoffLimitExceeded",
                                       "message": "Job has reached the specified backoff limit",
                                       "lastTransitionTime": _now(), "lastProbeTime": _now()})
                for p in pods:  # the Job controller terminates what still runs
                    if p.get("status", {}).get("phase") in ("Pending", "Running"):
                        self._remove("pods", ns, p["metadata"]["name"], "Background")
                status["active"] = 0
            elif status["succeeded"] >= job["spec"].get("completions", 1):
                for kind in ("SuccessCriteriaMet", "Complete"):
                    conditions.append({"type": kind, "status": "True", "lastTransitionTime": _now(),
                                       "lastProbeTime": _now()})
                status["completionTime"] = _now()
        self._bump("jobs", "MODIFIED", job)

    # ------------------------------------------------------------------ HTTP
    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        url = urlparse(h.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        with self.lock:
            self.requests.append(Recorded(h.command, url.path, query, {k.lower(): v for k, v in h.headers.items()}, body))
            for i, (method, pattern, status, times) in enumerate(self._faults):
                if method == h.command and pattern.search(h.path):
                    self._faults[i] = (method, pattern, status, times - 1)
                    if times <= 1:
                        del self._faults[i]
                    return self._send(h, status, _status(status, "InternalError" if status >= 500 else "Injected",
                                                         f"injected {status}"))
        m = ROUTE.match(url.path)
        if m is None:
            return self._send(h, 404, _status(404, "NotFound", f"the server could not find {url.path}"))
        kind, ns, name, sub = m.group("kind"), m.group("ns"), m.group("name"), m.group("sub")
        if m.group("group") != GROUP_OF.get(kind):
            return self._send(h, 404, _status(404, "NotFound", f"no {kind} in this API group"))
        if ns not in self.namespaces:
            return self._send(h, 404, _status(404, "NotFound", f'namespaces "{ns}" not found'))
        if h.command == "GET" and name is None and query.get("watch") in ("true", "True", "1"):
            return self._watch(h, kind, ns, query)
        if h.command == "GET" and kind == "pods" and sub == "log":
            return self._log(h, ns, name or "", query)
        with self.lock:
            code, payload, headers = self._dispatch(h.command, kind, ns, name, sub, query, body)
        if isinstance(payload, str):
            return self._send_text(h, code, payload)
        return self._send(h, code, payload, headers)

    def _dispatch(self, method: str, kind: str, ns: str, name: str | None, sub: str | None,
                  query: dict[str, str], body: Any) -> tuple[int, Any, dict[str, str]]:
        api_version, kind_name = KINDS[kind]
        if method == "POST" and name is None:
            return self._create(kind, ns, body)
        if method == "GET" and name is None:
            items = self.list(kind, ns, query.get("labelSelector"))
            return 200, {"kind": f"{kind_name}List", "apiVersion": api_version,
                         "metadata": {"resourceVersion": str(self.rv)}, "items": items}, {}
        obj = self.objects.get((kind, ns, name or ""))
        if obj is None:
            return 404, _status(404, "NotFound", f'{kind} "{name}" not found'), {}
        if method == "GET":
            return 200, copy.deepcopy(obj), {}
        if method == "DELETE":
            default = "Orphan" if kind == "jobs" else "Background"
            policy = query.get("propagationPolicy") or (body or {}).get("propagationPolicy") or default
            headers = {}
            if kind == "jobs" and policy == "Orphan" and not query.get("propagationPolicy") \
                    and not (body or {}).get("propagationPolicy"):
                headers["Warning"] = ('299 - "child pods are preserved by default when jobs are deleted; set '
                                      'propagationPolicy=Background to remove them or set propagationPolicy=Orphan '
                                      'to suppress this warning"')
            snapshot = copy.deepcopy(obj)
            self._remove(kind, ns, name or "", policy)
            return 200, _status(200, "", "") | {"status": "Success", "details": {"name": name, "kind": kind,
                                                                                  "uid": snapshot["metadata"]["uid"]}}, headers
        return 405, _status(405, "MethodNotAllowed", f"{method} is not supported by the fake"), {}

    def _create(self, kind: str, ns: str, body: dict[str, Any]) -> tuple[int, Any, dict[str, str]]:
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", ns)
        name = meta.get("name", "")
        problems = []
        if meta["namespace"] != ns:
            return 400, _status(400, "BadRequest", "the namespace of the object does not match the request"), {}
        if kind == "secrets":  # Secret names are subdomains; the others here are labels
            if len(name) > 253 or not DNS_SUBDOMAIN.match(name):
                problems.append(f"metadata.name: Invalid value: {name!r}: must be a DNS-1123 subdomain")
        elif len(name) > 63 or not DNS_LABEL.match(name):
            problems.append(f"metadata.name: Invalid value: {name!r}: must be a DNS-1123 label")
        for v in meta.get("labels", {}).values():
            if len(v) > 63 or not LABEL_VALUE.match(v):
                problems.append(f"metadata.labels: Invalid value: {v!r}")
        if kind == "jobs":
            spec = obj.get("spec", {})
            if spec.get("completionMode") == "Indexed" and "completions" not in spec:
                problems.append("spec.completions: Required value: when completion mode is Indexed")
            if spec.get("template", {}).get("spec", {}).get("restartPolicy") not in ("Never", "OnFailure"):
                problems.append("spec.template.spec.restartPolicy: Unsupported value")
        if kind == "secrets":
            problems += self._store_secret_data(obj)
        if problems:
            return 422, _status(422, "Invalid", f'{KINDS[kind][1]} "{name}" is invalid: ' + "; ".join(problems)), {}
        if (kind, ns, name) in self.objects:
            return 409, _status(409, "AlreadyExists", f'{kind} "{name}" already exists'), {}
        if kind == "services" and obj.get("spec", {}).get("clusterIP") is None:
            obj["spec"]["clusterIP"] = "10.96.0.10"
        self._add(kind, obj)
        if kind == "jobs":
            self._start_job(obj)
            self._bump("jobs", "MODIFIED", obj)
        return 201, copy.deepcopy(obj), {}

    @staticmethod
    def _store_secret_data(obj: dict[str, Any]) -> list[str]:
        """Merge the write-only `stringData` into `data` (base64) as the API server does; the problems."""
        problems = []
        data = obj.get("data") or {}
        for key, value in data.items():
            try:
                base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError, TypeError):
                problems.append(f"data[{key}]: Invalid value: not base64")
        for key, value in (obj.pop("stringData", None) or {}).items():
            data[key] = base64.b64encode(str(value).encode()).decode()
        for key in data:
            if len(key) > 253 or not SECRET_KEY.match(key):
                problems.append(f"data[{key}]: Invalid value: a valid config key must consist of alphanumeric "
                                "characters, '-', '_' or '.'")
        obj["data"] = data
        obj.setdefault("type", "Opaque")
        return problems

    def _watch(self, h: BaseHTTPRequestHandler, kind: str, ns: str, query: dict[str, str]) -> None:
        selector = query.get("labelSelector")
        timeout = float(query.get("timeoutSeconds", 30))
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

        def chunk(doc: dict[str, Any]) -> None:
            data = (json.dumps(doc) + "\n").encode()
            h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            h.wfile.flush()

        def visible(obj: dict[str, Any]) -> bool:
            return obj["metadata"]["namespace"] == ns and selector_matches(selector, obj["metadata"].get("labels", {}))

        deadline = time.monotonic() + timeout
        epoch = self._epoch
        try:
            with self.lock:
                rv_raw = query.get("resourceVersion")
                if not rv_raw or rv_raw == "0":
                    pending = [("ADDED", o) for o in self.list(kind, ns, selector)]
                    last = self.rv
                else:
                    last = int(rv_raw)
                    if last < self.compacted_rv:
                        pending = [("ERROR", _status(410, "Expired", f"too old resource version: {last} "
                                                              f"({self.compacted_rv})"))]
                        last = -1
                    else:
                        pending = []
            while True:
                for event, obj in pending:
                    chunk({"type": event, "object": obj})
                if last < 0:
                    break
                with self.lock:
                    fresh = [(rv, t, o) for rv, k, t, o in self.events if rv > last and k == kind and visible(o)]
                    if not fresh:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0 or self._epoch != epoch:
                            break
                        self.changed.wait(min(remaining, 0.2))
                        pending = []
                        continue
                    last = fresh[-1][0]
                    pending = [(t, copy.deepcopy(o)) for _, t, o in fresh]
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass

    def append_pod_log(self, name: str, text: str) -> None:
        """The pod's container writes `text` (a follower sees it at once)."""
        with self.lock:
            self.pod_logs[name] = self.pod_logs.get(name, "") + text
            self.changed.notify_all()

    def _log(self, h: BaseHTTPRequestHandler, ns: str, name: str, query: dict[str, str]) -> None:
        """GET .../pods/{name}/log as the API server answers it: `container` must name one of the pod's
        containers (400 otherwise; optional for a one-container pod), a pending pod's container has no log
yet (400, "waiting to start"), `tailLines` the last N lines; with
        `follow` the body is streamed (chunked) as the container writes, until it terminates."""
        with self.lock:
            pod = self.objects.get(("pods", ns, name))
            if pod is None:
                return self._send(h, 404, _status(404, "NotFound", f'pods "{name}" not found'))
            containers = [c["name"] for c in pod["spec"].get("containers", [])]
            container = query.get("container")
            if container is None and len(containers) != 1:
                return self._send(h, 400, _status(400, "BadRequest", f"a container name must be specified for pod "
                                                                    f"{name}, choose one of: {containers}"))
            if container is not None and container not in containers:
                return self._send(h, 400, _status(400, "BadRequest",
                                                  f"container {container} is not valid for pod {name}"))
            if pod.get("status", {}).get("phase", "Pending") == "Pending":
                return self._send(h, 400, _status(400, "BadRequest", f'container "{container or containers[0]}" in pod '
                                                                    f'"{name}" is waiting to start: ContainerCreating'))
            lines = self.pod_logs.get(name, "").splitlines(keepends=True)
            if "tailLines" in query:
                lines = lines[-int(query["tailLines"]):] if int(query["tailLines"]) else []
            sent = len(self.pod_logs.get(name, ""))
        if query.get("follow") not in ("true", "True", "1"):
            return self._send_text(h, 200, "".join(lines))
        h.send_response(200)
        h.send_header("Content-Type", "text/plain")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

        def chunk(text: str) -> None:
            if text:
                data = text.encode()
                h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                h.wfile.flush()

        try:
            chunk("".join(lines))
            while True:
                with self.lock:
                    text = self.pod_logs.get(name, "")
                    current = self.objects.get(("pods", ns, name))
                    over = current is None or current.get("status", {}).get("phase") in ("Succeeded", "Failed")
                    if len(text) == sent and not over:
                        self.changed.wait(0.2)
                        continue
                chunk(text[sent:])
                sent = len(text)
                if over:
                    break
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, code: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(data)

    @staticmethod
    def _send_text(h: BaseHTTPRequestHandler, code: int, text: str) -> None:
        data = text.encode()
        h.send_response(code)
        h.send_header("Content-Type", "text/plain")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)
