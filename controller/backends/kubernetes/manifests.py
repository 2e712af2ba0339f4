"""Render one attempt of a job into Kubernetes objects: an Indexed batch/v1 Job, a headless Service and a
Secret holding the job-scoped worker token.

Called by `backend.KubernetesBackend.submit` and by the golden-file tests. Pure functions of the
`Submission` (no API calls, no client models): plain dicts in the API's camelCase JSON shape, which the
official client sends as they are and `kubernetes_validate` checks against the upstream schemas.

Layout of one run named `<name>` (the deterministic `run_name`, so a resubmission names the same objects):

* Job `<name>`: `completionMode: Indexed`, `completions = parallelism = nodes`; pod `i` gets
  `JOB_COMPLETION_INDEX=i` (its node rank) and hostname `<name>-i`; `subdomain: <name>` puts that
  hostname under the Service, so node 0 is always `<name>-0.<name>.<namespace>.svc`.
  `restartPolicy: Never` and `backoffLimit: 0`: a failed pod fails the Job at once, because restarts
  are the controller's decision (a new attempt, possibly at another size), not the Job controller's.
* Service `<name>`: headless (`clusterIP: None`) with `publishNotReadyAddresses`, so the DNS names exist
  as soon as the pods do (the rendezvous happens before anything is "ready"). It carries an
  ownerReference to the Job (set after the Job exists, see `service`), so deleting the Job with
  `propagationPolicy: Background` removes the pods and the Service in one call.
* Secret `<name>-token`: the values of `SECRET_ENV` (the job-scoped `DEEPFLEET_TOKEN`), which the
  container reads through `valueFrom.secretKeyRef`, so reading the Job (or its pods' specs) does not
  reveal the token; every other variable stays a plain env value. Owned by the Job like the Service.
  An `env: {VAR: {secret: s, key: k}}` entry of the spec becomes `valueFrom.secretKeyRef` to the
  user's own Secret `s` (key `k`, default `value`) in the job's namespace; the project's policy
  (`ProjectPolicy.secrets`) says which Secrets it may name, and the value never passes the controller.
* With `spec.kubernetes.kueueQueue` the Job is created suspended with Kueue's queue-name label and
  Kueue admits it (unsuspends it) when its quota allows.

Checkpoints (`checkpoint_mounts`, `worker_spec`). A job with `kubernetes.checkpointClaim` mounts the claim
at `checkpoint.dir` and keeps its checkpoints in its own directory there, `<checkpoint.dir>/<project>/<job
id>` (`checkpoint_subpath`; the WorkerSpec's `checkpoint.dir`): every attempt of the job (same id) resumes
from them, and a job never picks up another's from a shared claim. The worker creates that directory
itself, as the image's user (a `subPath` the kubelet creates would be root's). A job that starts from
another job's checkpoint (`checkpoint.resumeFrom`, a ServingJob's `model.job`; the controller validated
at submit that the source ran here with a claim in the same namespace, `controller.sources`) mounts only
the source's directory on the source's claim, *read-only*, at `SOURCE_MOUNT` (the volume `readOnly`, the
mount `readOnly`, `subPath: <project>/<its job id>`, which its own worker created), and the WorkerSpec
says where: a serving job's `checkpoint.dir` is `SOURCE_MOUNT` (it loads the newest complete checkpoint
there and writes nothing); a training job's `resume_dir` is `SOURCE_MOUNT` (the worker copies the newest
complete checkpoint from there into its own directory when that holds none).
"""

from __future__ import annotations

import json
from typing import Any

from deepfleet.controller.backends.base import Submission
from deepfleet.controller.backends.kubernetes import names
from deepfleet.controller.spec import SECRET_KEY_DEFAULT, KubernetesOptions, node_bounds, secret_refs
from deepfleet.worker.spec import SERVE_PORT, TOKEN_ENV, WorkerSpec

CONTAINER = "worker"
WORKER_COMMAND = ["deepfleet-worker"]
DEFAULT_GRACE_SECONDS = 60  # covers the worker's default 30 s preemption checkpoint with margin
SHM_PATH = "/dev/shm"
SECRET_ENV = (TOKEN_ENV,)  # variables of the submission env that go into the Secret, not the Job
SOURCE_MOUNT = "/mnt/deepfleet/source-checkpoint"  # where another job's checkpoints are mounted read-only
CHECKPOINT_VOLUME = "checkpoints"
SOURCE_VOLUME = "source-checkpoint"


def _options(sub: Submission) -> KubernetesOptions:
    return sub.spec.spec.kubernetes or KubernetesOptions()


def namespace_of(sub: Submission, *, default: str) -> str:
    """The run's namespace: `spec.kubernetes.namespace`, else the backend's."""
    return _options(sub).namespace or default


def node_count(sub: Submission) -> int:
    """Pods started for the run: the job's full size (`nodes.max` for an elastic job)."""
    return node_bounds(sub.spec)[1]


def labels(sub: Submission) -> dict[str, str]:
    """Labels on the Job, its pods and the Service."""
    out = {
        names.MANAGED_BY: names.MANAGER,
        names.RUN: sub.name,
        names.JOB_ID: sub.job_id,
        names.ATTEMPT: str(sub.attempt),
        "app.kubernetes.io/name": "deepfleet-worker",
        "app.kubernetes.io/instance": sub.name,
    }
    if _options(sub).kueue_queue:
        out[names.KUEUE_QUEUE] = _options(sub).kueue_queue
    return out


def secret_name(run: str) -> str:
    """The name of the Secret holding the run's secret env values."""
    return f"{run}-token"


def _secret_values(sub: Submission) -> dict[str, str]:
    return {k: v for k, v in sorted(sub.env.items()) if k in SECRET_ENV}


def checkpoint_subpath(project: str, job_id: str) -> str:
    """The directory of a job's checkpoints on its claim, relative to the claim's root (every attempt of
    the job uses the same one)."""
    return f"{project}/{job_id}"


def checkpoint_mounts(sub: Submission) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volumeMounts) of the run's checkpoints: its own claim, read-write at `checkpoint.dir`, and
    the directory of the checkpoint it starts from, read-only at `SOURCE_MOUNT` (module docstring).
    Raises ValueError for a resumeFrom whose source this cluster cannot mount."""
    opts, checkpoint = _options(sub), sub.spec.spec.checkpoint
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if opts.checkpoint_claim and checkpoint is not None:
        volumes.append({"name": CHECKPOINT_VOLUME, "persistentVolumeClaim": {"claimName": opts.checkpoint_claim}})
        mounts.append({"name": CHECKPOINT_VOLUME, "mountPath": checkpoint.dir})
    if checkpoint is None or checkpoint.resume_from is None:
        return volumes, mounts
    source = sub.checkpoint_source
    if source is None or source.job_id != checkpoint.resume_from or source.backend != "kubernetes" or not source.claim:
        raise ValueError(f"checkpoint.resumeFrom: job {checkpoint.resume_from!r} kept no checkpoints on a claim of "
                         "this cluster; name a kubernetes job that had a checkpointClaim")
    volumes.append({"name": SOURCE_VOLUME, "persistentVolumeClaim": {"claimName": source.claim, "readOnly": True}})
    mounts.append({"name": SOURCE_VOLUME, "mountPath": SOURCE_MOUNT, "readOnly": True,
                   "subPath": checkpoint_subpath(source.project, source.job_id)})
    return volumes, mounts


def worker_spec(sub: Submission) -> WorkerSpec:
    """The WorkerSpec the pods receive: the compiled one, with its checkpoints in its own directory on its
    claim and told where a mounted source checkpoint is."""
    ws = sub.worker_spec
    if ws.checkpoint is None:
        return ws
    checkpoint, update = ws.checkpoint, {}
    if _options(sub).checkpoint_claim:
        own = f"{checkpoint.dir.rstrip('/')}/{checkpoint_subpath(sub.spec.metadata.project, sub.job_id)}"
        checkpoint = checkpoint.model_copy(update={"dir": own})
    if checkpoint.resume_from is not None and sub.checkpoint_source is not None:
        if ws.serve is not None:  # serve the source's checkpoint where it is mounted
            checkpoint = checkpoint.model_copy(update={"dir": SOURCE_MOUNT})
        else:
            update["resume_dir"] = SOURCE_MOUNT
    return ws.model_copy(update={"checkpoint": checkpoint, **update})


def _env(sub: Submission, *, nodes: int) -> list[dict[str, Any]]:
    ws = worker_spec(sub)
    fixed = {
        **{k: v for k, v in sub.env.items() if k not in SECRET_ENV},
        "DEEPFLEET_WORKER_SPEC": json.dumps(ws.model_dump(mode="json", exclude_none=True), sort_keys=True),
        # Read by worker/rendezvous.py (platform kubernetes); JOB_COMPLETION_INDEX comes from Kubernetes.
        "DEEPFLEET_K8S_JOB": sub.name,
        "DEEPFLEET_RDZV_SERVICE": sub.name,
        "DEEPFLEET_NNODES": str(nodes),
        "DEEPFLEET_MASTER_PORT": str(ws.rendezvous.port),
    }
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in sorted(fixed.items())]
    env.extend({"name": k, "valueFrom": {"secretKeyRef": {"name": secret_name(sub.name), "key": k}}}
               for k in _secret_values(sub))
    # The spec's own secret references: Secrets in the job's namespace (the policy says which).
    env.extend({"name": var, "valueFrom": {"secretKeyRef": {"name": ref.secret, "key": ref.key or SECRET_KEY_DEFAULT}}}
               for var, ref in sorted(secret_refs(sub.spec).items()))
    env.append({"name": "DEEPFLEET_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}})
    env.append({"name": "DEEPFLEET_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
    return env


def _resources(sub: Submission) -> dict[str, Any]:
    r = sub.spec.spec.resources
    amounts: dict[str, str] = {}
    if r.cpu:
        amounts["cpu"] = r.cpu
    if r.memory:
        amounts["memory"] = r.memory
    out: dict[str, Any] = {}
    if amounts:
        out["requests"] = dict(amounts)
        out["limits"] = dict(amounts)
    if r.gpu:
        # Extended resources are limits-only (the request defaults to the limit).
        out.setdefault("limits", {})["nvidia.com/gpu"] = str(r.gpu)
    return out


def _pod_spec(sub: Submission, *, nodes: int) -> dict[str, Any]:
    opts = _options(sub)
    ws = sub.worker_spec
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": sub.spec.spec.image,
        "command": list(WORKER_COMMAND),
        "env": _env(sub, nodes=nodes),
        "ports": [{"name": "rendezvous", "containerPort": ws.rendezvous.port, "protocol": "TCP"}]
        + ([{"name": "http", "containerPort": SERVE_PORT, "protocol": "TCP"}] if ws.serve is not None else []),
        "volumeMounts": [{"name": "dshm", "mountPath": SHM_PATH}],
    }
    resources = _resources(sub)
    if resources:
        container["resources"] = resources
    shm: dict[str, Any] = {"medium": "Memory"}
    if opts.shm_size:
        shm["sizeLimit"] = opts.shm_size
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": shm}]
    # Every attempt's pods mount the same claim, so a new attempt resumes from the latest checkpoint.
    checkpoint_volumes, checkpoint_mounts_ = checkpoint_mounts(sub)
    volumes += checkpoint_volumes
    container["volumeMounts"] += checkpoint_mounts_
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "subdomain": sub.name,
        "terminationGracePeriodSeconds": (opts.termination_grace_period_seconds
                                          if opts.termination_grace_period_seconds is not None
                                          else DEFAULT_GRACE_SECONDS),
        "containers": [container],
        "volumes": volumes,
    }
    selector = dict(opts.node_selector)
    if sub.spec.spec.resources.gpu_type:
        selector.setdefault(names.GPU_PRODUCT, sub.spec.spec.resources.gpu_type)
    if selector:
        pod["nodeSelector"] = selector
    if opts.tolerations:
        pod["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in opts.tolerations]
    if opts.priority_class_name:
        pod["priorityClassName"] = opts.priority_class_name
    if opts.service_account_name:
        pod["serviceAccountName"] = opts.service_account_name
    if opts.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": n} for n in opts.image_pull_secrets]
    return pod


def job(sub: Submission, *, namespace: str) -> dict[str, Any]:
    """The Indexed batch/v1 Job of the run (see the module docstring for its shape)."""
    nodes = node_count(sub)
    names.check_dns_label(sub.name, where="job name")
    names.check_dns_label(names.pod_hostname(sub.name, nodes - 1), where="pod hostname")
    names.check_dns_label(secret_name(sub.name), where="secret name")
    names.check_dns_label(namespace, where="spec.kubernetes.namespace")
    lab = labels(sub)
    names.check_labels(lab, where="job")
    spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": nodes,
        "parallelism": nodes,
        "backoffLimit": 0,
        "template": {"metadata": {"labels": dict(lab)}, "spec": _pod_spec(sub, nodes=nodes)},
    }
    if _options(sub).kueue_queue:
        spec["suspend"] = True  # Kueue unsuspends the Job when it admits it
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": sub.name, "namespace": namespace, "labels": lab,
                     "annotations": {"deepfleet.dev/job-name": sub.spec.metadata.name,
                                     "deepfleet.dev/project": sub.spec.metadata.project}},
        "spec": spec,
    }


def _owned_metadata(sub: Submission, *, name: str, namespace: str, job_uid: str | None) -> dict[str, Any]:
    """Metadata of an object the Job owns: the run's labels (less Kueue's) and, with `job_uid`, the
    ownerReference that lets the Background delete of the Job remove it."""
    lab = labels(sub)
    lab.pop(names.KUEUE_QUEUE, None)  # Kueue manages workloads, not Services or Secrets
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": lab}
    if job_uid is not None:
        meta["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job", "name": sub.name, "uid": job_uid,
                                    "blockOwnerDeletion": True}]
    return meta


def service(sub: Submission, *, namespace: str, job_uid: str | None) -> dict[str, Any]:
    """The headless Service that gives every pod `<hostname>.<name>.<namespace>.svc`.

    `job_uid`: the created Job's uid, for the ownerReference (None only when rendering for review)."""
    meta = _owned_metadata(sub, name=sub.name, namespace=namespace, job_uid=job_uid)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {names.RUN: sub.name},
            "ports": [{"name": "rendezvous", "port": sub.worker_spec.rendezvous.port,
                       "targetPort": sub.worker_spec.rendezvous.port, "protocol": "TCP"}]
            # A serving run's endpoint: http://<name>.<namespace>.svc:SERVE_PORT inside the cluster.
            + ([{"name": "http", "port": SERVE_PORT, "targetPort": SERVE_PORT, "protocol": "TCP"}]
               if sub.worker_spec.serve is not None else []),
        },
    }


def secret(sub: Submission, *, namespace: str, job_uid: str | None) -> dict[str, Any]:
    """The Opaque Secret `<name>-token` with the run's `SECRET_ENV` values (one key per variable name).

    Sent as `stringData`; the API server stores it base64-encoded in `data`. Immutable: a new attempt
    gets a new Secret. `job_uid` as for `service`."""
    name = secret_name(sub.name)
    names.check_dns_label(name, where="secret name")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _owned_metadata(sub, name=name, namespace=namespace, job_uid=job_uid),
        "type": "Opaque",
        "immutable": True,
        "stringData": _secret_values(sub),
    }


def network_policy(sub: Submission, *, namespace: str, job_uid: str | None) -> dict[str, Any]:
    """The NetworkPolicy `<name>-peers`: the run's pods accept ingress (the rendezvous port and the
    collectives' ephemeral ports alike, hence every port) only from pods of the same run in the same
    namespace. Egress stays open (heartbeats to the controller, data, registries). `job_uid` as for
    `service`."""
    name = f"{sub.name}-peers"
    names.check_dns_label(name, where="network policy name")
    peers = {"matchLabels": {names.RUN: sub.name}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _owned_metadata(sub, name=name, namespace=namespace, job_uid=job_uid),
        "spec": {"podSelector": peers, "policyTypes": ["Ingress"], "ingress": [{"from": [{"podSelector": peers}]}]},
    }


def render(sub: Submission, *, namespace: str, job_uid: str | None = None) -> list[dict[str, Any]]:
    """[Job, Secret, Service] of one attempt, in the order `submit` creates them."""
    ns = namespace_of(sub, default=namespace)
    return [job(sub, namespace=ns), secret(sub, namespace=ns, job_uid=job_uid),
            service(sub, namespace=ns, job_uid=job_uid)]
