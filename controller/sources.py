"""Where another job's checkpoints are, for a job that starts from them (`checkpoint.resumeFrom`) or serves
them (a ServingJob's `model.job`), and whether the new job's backend can reach them.

Called by `controller.db.jobs.create_job` at submit (`reach_errors`: one "<field>: <problem>; <fix>" line
per reason the source cannot be read from the new job's backend) and by `controller.reconciler` when it
compiles an attempt (`checkpoint_source`: the `CheckpointSource` the backend mounts). Both read the
controller's stored record of the source job (its backend and its stored spec document), never a path
the user wrote.

What each backend can reach:

* local: the source's job area on the controller's host (`controller.confine`); the backend copies its
  newest complete checkpoint into the new job's own area.
* kubernetes: the source's `kubernetes.checkpointClaim`, a PersistentVolumeClaim on which every job keeps
  its checkpoints under its own directory (`<project>/<job id>`, see `kubernetes/manifests.py`); the new
  job's pod mounts that directory read-only. A claim is a namespaced object, so the new job must run in
  the source's namespace, and the project's policy must still allow the claim.
* azureml: the source's checkpoint folder on the workspace's datastore
  (`<project>/<job id>/checkpoints`, the training job's `checkpoints` output, see `backends/azureml.py`);
  the new job gets it as a read-only `uri_folder` input.

A source on another backend than the new job's is refused: neither the cluster nor the workspace can
read the controller's disk, or each other's volumes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CheckpointSource:
    """The stored facts about the job whose checkpoint an attempt starts from or serves."""

    job_id: str
    project: str
    backend: str
    dir: str | None = None  # the source's `checkpoint.dir` (None: it kept no checkpoints)
    claim: str | None = None  # kubernetes: the source's `checkpointClaim`
    namespace: str | None = None  # kubernetes: the source's `kubernetes.namespace` (None: the controller's)


def checkpoint_source(job_id: str, *, project: str, backend: str, document: dict[str, Any]) -> CheckpointSource:
    """The CheckpointSource of a stored job (`document`: its stored spec, as `Job.spec` holds it)."""
    spec = document.get("spec") or {}
    kubernetes = spec.get("kubernetes") or {}
    return CheckpointSource(job_id=job_id, project=project, backend=backend,
                            dir=(spec.get("checkpoint") or {}).get("dir"),
                            claim=kubernetes.get("checkpointClaim"), namespace=kubernetes.get("namespace"))


def reach_errors(source: CheckpointSource, *, backend: str, namespace: str | None, field: str,
                 default_namespace: str, allowed_claims: list[str]) -> list[str]:
    """Why a job on `backend` (in `namespace` on kubernetes; None: the controller's) cannot read the
    checkpoints of `source`, one line each naming `field` (empty: it can)."""
    name = source.job_id
    if source.backend != backend:
        return [f"{field}: job {name!r} ran on backend {source.backend}, where a job on backend {backend} cannot "
                f"read its checkpoints; name a job that ran on backend {backend}, or run this one on {source.backend}"]
    if backend == "local":
        return []  # the local backend reports a missing checkpoint when it copies one
    if source.dir is None:
        return [f"{field}: job {name!r} kept no checkpoints (its spec has no checkpoint section); name a job "
                "that saved one"]
    if backend != "kubernetes":
        return []
    if source.claim is None:
        return [f"{field}: job {name!r} kept its checkpoints on no volume (no kubernetes.checkpointClaim), so they "
                "were gone with its pods; name a job that had a checkpointClaim"]
    errors = []
    src_ns, dst_ns = source.namespace or default_namespace, namespace or default_namespace
    if src_ns != dst_ns:
        errors.append(f"{field}: job {name!r} keeps its checkpoints on claim {source.claim!r} in namespace "
                      f"{src_ns!r}, which pods in {dst_ns!r} cannot mount; set spec.kubernetes.namespace: {src_ns}")
    if source.claim not in allowed_claims:
        listed = ", ".join(allowed_claims) if allowed_claims else "none"
        errors.append(f"{field}: job {name!r} keeps its checkpoints on claim {source.claim!r}, which this project "
                      f"may no longer mount (allowed: {listed}); ask an admin to allow it")
    return errors
