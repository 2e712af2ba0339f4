"""A list-then-watch cache of the pods of every run in one namespace (the informer pattern, minimal).

Used by `backend.KubernetesBackend.observe`, which reads pod states (phase, exit codes, termination
reasons) from here instead of listing pods on every reconcile pass. A daemon thread lists the pods
carrying our managed-by label, then watches from the list's resourceVersion; each event moves the
resourceVersion forward, so a watch that times out resumes where it stopped. A `410 Gone/Expired`
(the API server compacted its history past our resourceVersion) drops the version and relists, so no
terminal pod state is ever missed; other errors back off and relist. Hand-written because the official
client has only the raw `watch.Watch` stream, not an informer.
"""

from __future__ import annotations

import copy
import logging
import threading
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

log = logging.getLogger(__name__)


class PodWatcher:
    """Keeps `pods` (name -> raw pod dict) current for pods matching `selector` in `namespace`."""

    def __init__(self, core: client.CoreV1Api, namespace: str, *, selector: str, timeout_s: int = 30,
                 backoff_s: float = 1.0) -> None:
        self.core = core
        self.namespace = namespace
        self.selector = selector
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.resource_version: str | None = None
        self.relists = 0  # how many times the cache was rebuilt from a list (1 + one per expiry/error)
        self.synced = threading.Event()
        self._pods: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: watch.Watch | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> PodWatcher:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"pod-watch-{self.namespace}", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
            # Unblock a read waiting on the open stream (urllib3 >= 2.3); else the thread ends when the
            # watch's timeoutSeconds runs out.
            resp = getattr(self._watch, "_resp", None)
            if resp is not None and hasattr(resp, "shutdown"):
                try:
                    resp.shutdown()
                except (OSError, ValueError):
                    # The stream's socket is already closed, not yet connected, or already released to the
                    # pool (urllib3 raises ValueError then): nothing is blocked on it.
                    pass
        if self._thread is not None:
            self._thread.join(timeout=1)  # a daemon: a stream still open ends at its timeout

    # ------------------------------------------------------------------ reads
    def pods_of(self, run: str, *, run_label: str) -> list[dict[str, Any]]:
        """Copies of the cached pods whose `run_label` is `run`."""
        with self._lock:
            return [copy.deepcopy(p) for p in self._pods.values()
                    if p["metadata"].get("labels", {}).get(run_label) == run]

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        """The watch loop: a named best-effort loop, so any error is logged and answered by a relist;
        while the cache is not rebuilt, `synced` is clear and readers fall back to a direct list."""
        while not self._stop.is_set():
            try:
                if self.resource_version is None:
                    self._relist()
                self._watch_once()
            except ApiException as e:
                if e.status == 410:  # history compacted past our version: rebuild from a fresh list
                    log.info("pod watch in %s expired (%s); relisting", self.namespace, e.reason)
                    self.resource_version = None
                    continue
                log.warning("pod watch in %s failed (HTTP %s); relisting in %.0fs", self.namespace, e.status,
                            self.backoff_s)
                self._backoff()
            except (HTTPError, OSError) as e:
                if self._stop.is_set():
                    return
                log.warning("pod watch in %s lost its connection (%s); relisting", self.namespace, e)
                self._backoff()
            except Exception:
                log.exception("pod watch in %s failed; relisting", self.namespace)
                self._backoff()

    def _backoff(self) -> None:
        self.synced.clear()
        self.resource_version = None
        self._stop.wait(self.backoff_s)

    def _relist(self) -> None:
        listing = self.core.list_namespaced_pod(self.namespace, label_selector=self.selector)
        pods = self.core.api_client.sanitize_for_serialization(listing.items)
        with self._lock:
            self._pods = {p["metadata"]["name"]: p for p in pods}
        self.resource_version = listing.metadata.resource_version
        self.relists += 1
        self.synced.set()

    def _watch_once(self) -> None:
        self._watch = watch.Watch()
        for event in self._watch.stream(self.core.list_namespaced_pod, self.namespace, label_selector=self.selector,
                                        resource_version=self.resource_version, timeout_seconds=self.timeout_s):
            obj = event["raw_object"]
            name = obj["metadata"]["name"]
            with self._lock:
                if event["type"] == "DELETED":
                    self._pods.pop(name, None)
                elif event["type"] in ("ADDED", "MODIFIED"):
                    self._pods[name] = obj
            if obj["metadata"].get("resourceVersion"):
                self.resource_version = obj["metadata"]["resourceVersion"]
            if self._stop.is_set():
                self._watch.stop()
