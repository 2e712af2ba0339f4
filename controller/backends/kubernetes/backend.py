"""The Kubernetes backend: one run = an Indexed Job, a headless Service and a token Secret (see `manifests.py`).

Called by `controller.reconciler` through the `Backend` protocol; built by the server from settings
(`connect` loads a kubeconfig or the in-cluster service account into its own `ApiClient`, never the
client's global configuration). Uses the official `kubernetes` client only; this sub-package is the
only place that imports it.

* submit: create the Job, then the Secret with the worker token and the Service, both with an
  ownerReference to the Job's uid (pods that start before the Secret exists wait in
  CreateContainerConfigError and the kubelet starts them once it does). 409 AlreadyExists on any of
  them is success (deterministic names make resubmission a no-op); a Job of that name that belongs to
  another job id is an error.
* observe: GET the Job, read its pods from a list+watch cache (`watch.PodWatcher`; a direct list
  while the cache is not synced or lags behind a finished Job), map both with `status.observation`.
* cancel: DELETE the Job with `propagationPolicy: Background`; the garbage collector removes the pods
  and the owned Service and Secret. (Without a policy a batch/v1 Job delete *orphans* its pods.) 404 is success.
* logs: the container log of the newest pod of a node (`tailLines`, `follow`).

Every client error is translated here: 5xx, 429 and connection failures are transient
`BackendError`s, any other status is permanent.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException
from urllib3.exceptions import HTTPError

from deepfleet.controller.backends.base import BackendError, Observation, Submission
from deepfleet.controller.backends.kubernetes import manifests, names, status
from deepfleet.controller.backends.kubernetes.watch import PodWatcher

log = logging.getLogger(__name__)
T = TypeVar("T")
LOG_TAIL_LINES = 50
SELECTOR = f"{names.MANAGED_BY}={names.MANAGER}"


def connect(kubeconfig: str | None = None, *, context: str | None = None) -> client.ApiClient:
    """An ApiClient from `kubeconfig` (or $KUBECONFIG / ~/.kube/config), or from the pod's service account
    when running in a cluster without an explicit kubeconfig. Raises BackendError (permanent)."""
    try:
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            cfg = client.Configuration()
            config.load_incluster_config(client_configuration=cfg)
            return client.ApiClient(cfg)
        # $KUBECONFIG is read now: the client library reads it once, when it is first imported.
        return config.new_client_from_config(config_file=kubeconfig or os.environ.get("KUBECONFIG"), context=context)
    except (ConfigException, OSError) as e:
        raise BackendError(f"kubernetes: cannot load cluster credentials ({e}); set KUBECONFIG or run "
                           "the controller in the cluster", transient=False) from e


def _message(e: ApiException) -> str:
    try:
        return json.loads(e.body).get("message") or str(e.reason)
    except (TypeError, ValueError, AttributeError):
        return str(e.reason)


def translate(e: Exception, what: str) -> BackendError:
    """The BackendError for a client exception: transient for 5xx, 429 and connection errors."""
    if isinstance(e, ApiException):
        transient = e.status in (0, None, 429) or (e.status or 0) >= 500
        return BackendError(f"kubernetes: {what}: HTTP {e.status}: {_message(e)}", transient=transient)
    return BackendError(f"kubernetes: {what}: cannot reach the API server ({e})", transient=True)


class KubernetesBackend:
    """Runs jobs as Indexed Jobs in `namespace` (a job's `spec.kubernetes.namespace` overrides it)."""

    name = "kubernetes"

    def __init__(self, api_client: client.ApiClient, *, namespace: str = "default", watch_timeout_s: int = 30) -> None:
        self.api_client = api_client
        self.namespace = namespace
        self.watch_timeout_s = watch_timeout_s
        self.core = client.CoreV1Api(api_client)
        self.batch = client.BatchV1Api(api_client)
        self.networking = client.NetworkingV1Api(api_client)
        self._namespaces: dict[str, str] = {}  # run name -> namespace, for runs outside `namespace`
        self._watchers: dict[str, PodWatcher] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        """Stop the pod watches and release the connection pool."""
        for w in list(self._watchers.values()):
            w.stop()
        self.api_client.close()

    # ------------------------------------------------------------------ helpers
    def _call(self, what: str, fn: Callable[..., T], *args: Any, ok: tuple[int, ...] = (), **kwargs: Any) -> T | None:
        """Call the client; statuses in `ok` return None, everything else raising becomes a BackendError."""
        try:
            return fn(*args, **kwargs)
        except ApiException as e:
            if e.status in ok:
                return None
            raise translate(e, what) from e
        except (HTTPError, OSError) as e:
            raise translate(e, what) from e

    def _ns(self, run: str) -> str:
        return self._namespaces.get(run, self.namespace)

    def watcher(self, namespace: str) -> PodWatcher:
        """The (started) pod cache of `namespace`."""
        with self._lock:
            if namespace not in self._watchers:
                self._watchers[namespace] = PodWatcher(self.core, namespace, selector=SELECTOR,
                                                       timeout_s=self.watch_timeout_s).start()
            return self._watchers[namespace]

    def _pods(self, run: str, namespace: str) -> list[dict[str, Any]]:
        selector = f"{names.RUN}={run}"
        listing = self._call(f"list pods of {run}", self.core.list_namespaced_pod, namespace, label_selector=selector)
        return self.api_client.sanitize_for_serialization(listing.items) if listing else []

    # ------------------------------------------------------------------ Backend protocol
    def submit(self, sub: Submission) -> None:
        ns = manifests.namespace_of(sub, default=self.namespace)
        try:
            job = manifests.job(sub, namespace=ns)
        except ValueError as e:
            raise BackendError(f"kubernetes: {e}", transient=False) from e
        if ns != self.namespace:
            self._namespaces[sub.name] = ns
        created = self._call(f"create Job {ns}/{sub.name}", self.batch.create_namespaced_job, ns, job, ok=(409,))
        if created is None:  # it exists: ours from an earlier submit, or a name clash
            created = self._call(f"read Job {ns}/{sub.name}", self.batch.read_namespaced_job, sub.name, ns)
            owner = (created.metadata.labels or {}).get(names.JOB_ID)
            if owner != sub.job_id:
                raise BackendError(f"kubernetes: Job {ns}/{sub.name} exists and belongs to job {owner!r}, not "
                                   f"{sub.job_id}; delete it or rename the job", transient=False)
        token = manifests.secret(sub, namespace=ns, job_uid=created.metadata.uid)
        self._call(f"create Secret {ns}/{token['metadata']['name']}", self.core.create_namespaced_secret, ns, token,
                   ok=(409,))
        svc = manifests.service(sub, namespace=ns, job_uid=created.metadata.uid)
        self._call(f"create Service {ns}/{sub.name}", self.core.create_namespaced_service, ns, svc, ok=(409,))
        peers = manifests.network_policy(sub, namespace=ns, job_uid=created.metadata.uid)
        self._call(f"create NetworkPolicy {ns}/{peers['metadata']['name']}",
                   self.networking.create_namespaced_network_policy, ns, peers, ok=(409,))
        self.watcher(ns)

    def observe(self, name: str) -> Observation:
        ns = self._ns(name)
        found = self._call(f"read Job {ns}/{name}", self.batch.read_namespaced_job, name, ns, ok=(404,))
        if found is None:
            return status.observation(None, [], nodes=0)
        job = self.api_client.sanitize_for_serialization(found)
        nodes = int(job["spec"].get("completions") or 1)
        cache = self.watcher(ns)
        pods = cache.pods_of(name, run_label=names.RUN) if cache.synced.is_set() else None
        finished = bool(status.condition(job, "Complete", "SuccessCriteriaMet", "Failed", "FailureTarget"))
        if pods is None or (finished and not any(status.terminated(p) for p in pods)):
            pods = self._pods(name, ns)  # the cache may trail the Job by an event; ask once
        return status.observation(job, pods, nodes=nodes, log_tail=lambda pod: self._tail(pod, ns))

    def cancel(self, name: str) -> None:
        ns = self._ns(name)
        self._call(f"delete Job {ns}/{name}", self.batch.delete_namespaced_job, name, ns,
                   propagation_policy="Background", ok=(404,))

    def logs(self, name: str, *, node: int = 0, tail: int | None = None, follow: bool = False) -> Iterator[str]:
        ns = self._ns(name)
        selector = f"{names.RUN}={name},{names.COMPLETION_INDEX}={node}"
        listing = self._call(f"list pods of {name}", self.core.list_namespaced_pod, ns, label_selector=selector)
        pods = sorted(listing.items if listing else [], key=lambda p: p.metadata.creation_timestamp or 0)
        if not pods:
            raise BackendError(f"kubernetes: run {name} has no pod for node {node} in {ns}", transient=False)
        pod = pods[-1].metadata.name
        kwargs: dict[str, Any] = {"container": manifests.CONTAINER}
        if tail is not None:
            kwargs["tail_lines"] = tail
        # Raw responses: client 36 deserializes a text log as the repr of its bytes ("b'...'").
        resp = self._call(f"read log of {ns}/{pod}", self.core.read_namespaced_pod_log, pod, ns, follow=follow,
                          _preload_content=False, **kwargs)
        buffer = b""
        try:
            for chunk in resp.stream(4096):
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    yield line.decode(errors="replace") + "\n"
            if buffer:
                yield buffer.decode(errors="replace")
        except (HTTPError, OSError) as e:
            raise translate(e, f"read log of {ns}/{pod}") from e
        finally:
            resp.release_conn()

    def _tail(self, pod: dict[str, Any], namespace: str) -> str:
        """The last lines of a failed pod's log, for classification (best effort: '' when unreadable)."""
        try:
            resp = self.core.read_namespaced_pod_log(pod["metadata"]["name"], namespace, container=manifests.CONTAINER,
                                                     tail_lines=LOG_TAIL_LINES, _preload_content=False)
            return resp.data.decode(errors="replace")
        except (ApiException, HTTPError, OSError) as e:
            log.info("no log tail for %s: %s", pod["metadata"]["name"], e)
            return ""
