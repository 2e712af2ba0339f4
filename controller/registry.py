"""Register a job's exported model in a model registry, linked back to its job: MLflow's here, an Azure
ML workspace's in `controller.backends.azureml` (the one module that imports azure-ai-ml).

Callers: `deepfleet register MODEL.safetensors --name NAME` (controller/cli_jobs.py) and users' scripts
(`register_model`), and the reconciler, which registers a job that asked for it (`spec.registerModel`)
when the job succeeds, through a `ModelRegistry` (`MlflowRegistry` on the local backend). The model file
must carry its job's provenance: `deepfleet checkpoint export --provenance` writes it, and the reconciler
stamps the job's chain into a copy of the file the worker exported (`stamp`: the tensor bytes are copied
as they are, only the safetensors header changes). The registry entry's tags name the job id and the
provenance chain's head hash read from the file, so the entry, the file and the controller's record point
at each other.

MLflow does the storing: a run in experiment "deepfleet" holds the file as an artifact, and a model
version of registered model NAME points at it. The default store is local (`sqlite:///<dir>/mlflow.db`,
artifacts under `<dir>/artifacts`; MLflow's plain file store is deprecated); any tracking URI (an MLflow
server) works when given.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

EXPERIMENT = "deepfleet"
JOB_TAG = "deepfleet.job_id"
HEAD_TAG = "deepfleet.provenance_head"
CHAIN_KEY = "deepfleet.provenance"
URL_TAG = "deepfleet.job_url"
_CHUNK = 1 << 20
MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound on the JSON header


class RegistryError(ValueError):
    """A model that cannot be registered as it stands (retrying will not help); the message names the
    problem and the fix."""


@dataclass(frozen=True)
class Registered:
    name: str
    version: str
    run_id: str
    source: str
    job_id: str
    provenance_head: str
    uri: str = ""  # how the registry names the entry (models:/NAME/VERSION, azureml:NAME:VERSION)


@dataclass(frozen=True)
class ExportedModel:
    """Where a succeeded job's exported model is, as the backend that ran it hands it over: a file the
    controller can read (`path`) or an address in the backend's own store (`uri`), and what the worker
    wrote about it (`manifest`: its export.json, `deepfleet.worker.spec.ExportManifest` fields)."""

    path: Path | None = None
    uri: str | None = None
    manifest: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RegistrationRequest:
    """One succeeded job's model to register as a version of `name`."""

    name: str
    job_id: str
    job_name: str
    project: str
    job_url: str
    records: list[dict[str, Any]]  # the job's provenance chain, in seq order (as the API serves it)
    model: ExportedModel

    @property
    def head(self) -> str:
        return self.records[-1]["hash"] if self.records else ""

    @property
    def description(self) -> str:
        return f"deepfleet job {self.job_id} ({self.job_name}, project {self.project}): {self.job_url}"


class ModelRegistry(Protocol):
    """Where the reconciler registers succeeded jobs' models."""

    kind: str  # "mlflow" | "azureml": recorded on the job

    def register(self, request: RegistrationRequest) -> Registered:
        """Register `request.model` as the next version of `request.name`, tagged with the job. Idempotent
        per (name, job): a version already tagged with the job is returned as it is. Raises RegistryError
        when the model cannot be registered as it stands; any other exception is a registry that could
        not be reached or failed, worth a retry."""
        ...


def provenance_metadata(job_id: str, records: list[dict[str, Any]]) -> dict[str, str]:
    """The safetensors metadata that carries a job's provenance: the same keys and text as
    `deepfleet.engine.provenance.model_metadata` (a test holds the two equal)."""
    return {JOB_TAG: job_id, HEAD_TAG: records[-1]["hash"] if records else "",
            CHAIN_KEY: json.dumps(records, sort_keys=True, separators=(",", ":"), ensure_ascii=False)}


def _read_header(f: Any, where: Path) -> tuple[int, dict[str, Any]]:
    try:
        size = int.from_bytes(f.read(8), "little")
        if not 2 <= size <= MAX_HEADER_BYTES:
            raise ValueError(f"header length {size} out of range")
        header = json.loads(f.read(size))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (OSError, ValueError) as e:
        raise RegistryError(f"{where}: not a readable safetensors file ({e}); give the exported model") from None
    return size, header


def stamp(src: Path, dst: Path, metadata: Mapping[str, str]) -> str:
    """Copy safetensors file `src` to `dst` with `metadata` merged into its header's `__metadata__`; the
    tensor bytes are copied unchanged (their offsets are relative to the header's end). `src` is opened
    without following a link. Returns the sha256 (hex) of `src` as read. Raises RegistryError."""
    h = hashlib.sha256()
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise RegistryError(f"{src}: cannot open the exported model ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        size, header = _read_header(f, src)
        f.seek(0)
        h.update(f.read(8 + size))
        header["__metadata__"] = {**(header.get("__metadata__") or {}), **metadata}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # keep the data section 8-byte aligned
        tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
        try:
            with tmp.open("wb") as out:
                out.write(len(text).to_bytes(8, "little"))
                out.write(text)
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
                    out.write(chunk)
            os.replace(tmp, dst)
        finally:
            tmp.unlink(missing_ok=True)
    return h.hexdigest()


def model_provenance(path: Path) -> dict[str, str]:
    """The deepfleet provenance keys of a safetensors file's metadata (header only; no tensor is read)."""
    try:
        with path.open("rb") as f:
            _, header = _read_header(f, path)
    except OSError as e:
        raise RegistryError(f"{path}: not a readable safetensors file ({e}); give the exported model") from None
    meta = header.get("__metadata__") or {}
    if JOB_TAG not in meta or HEAD_TAG not in meta:
        raise RegistryError(f"{path}: carries no job provenance; export it with `deepfleet checkpoint export "
                            "... --provenance provenance.json` first")
    return meta


def default_store(root: Path) -> str:
    return f"sqlite:///{root.resolve() / 'mlflow.db'}"


def register_model(path: str | Path, *, name: str, tracking_uri: str | None = None,
                   registry_uri: str | None = None, store_dir: str | Path = "mlruns",
                   tags: Mapping[str, str] | None = None, description: str | None = None,
                   once: bool = False) -> Registered:
    """Log `path` as an artifact of a new run and register it as a version of model `name`, tagged with
    its job id and provenance head (and `tags`). `tracking_uri` default: a local store under `store_dir`.
    `once`: a version of `name` already tagged with this job id is returned instead of adding another."""
    try:
        from mlflow import MlflowClient
    except ImportError:
        raise RegistryError("MLflow is not installed here; install the monitor extra "
                            "(pip install 'deepfleet[monitor]')") from None

    path = Path(path)
    meta = model_provenance(path)
    root = Path(store_dir)
    if tracking_uri is None:
        root.mkdir(parents=True, exist_ok=True)
        tracking_uri = default_store(root)
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=registry_uri or tracking_uri)
    job_id = meta[JOB_TAG]
    if once:
        for found in client.search_model_versions(f"name = '{name}' and tags.`{JOB_TAG}` = '{job_id}'"):
            return Registered(name=name, version=str(found.version), run_id=found.run_id or "", source=found.source,
                              job_id=job_id, provenance_head=(found.tags or {}).get(HEAD_TAG, ""),
                              uri=f"models:/{name}/{found.version}")
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is not None:
        experiment_id = experiment.experiment_id
    else:
        location = (root.resolve() / "artifacts").as_uri() if tracking_uri.startswith("sqlite:") else None
        experiment_id = client.create_experiment(EXPERIMENT, artifact_location=location)
    all_tags = {**(tags or {}), JOB_TAG: job_id, HEAD_TAG: meta[HEAD_TAG]}
    run = client.create_run(experiment_id, tags=all_tags, run_name=f"job-{job_id[:8]}")
    client.log_artifact(run.info.run_id, str(path), artifact_path="model")
    client.set_terminated(run.info.run_id)
    if client.search_registered_models(filter_string=f"name = '{name}'") == []:
        client.create_registered_model(name)
    source = f"{run.info.artifact_uri}/model/{path.name}"
    version = client.create_model_version(name, source=source, run_id=run.info.run_id, tags=all_tags,
                                          description=description or f"deepfleet job {job_id}")
    return Registered(name=name, version=str(version.version), run_id=run.info.run_id, source=source,
                      job_id=job_id, provenance_head=meta[HEAD_TAG], uri=f"models:/{name}/{version.version}")


class MlflowRegistry:
    """The reconciler's MLflow registry: stamps the job's chain into a copy of the exported file (under
    `scratch_dir`, removed afterwards) and registers the copy once per job."""

    kind = "mlflow"

    def __init__(self, *, tracking_uri: str | None, store_dir: Path, scratch_dir: Path) -> None:
        """`tracking_uri` None: the local store under `store_dir`."""
        self.tracking_uri = tracking_uri
        self.store_dir = Path(store_dir)
        self.scratch_dir = Path(scratch_dir)

    def register(self, request: RegistrationRequest) -> Registered:
        src = request.model.path
        if src is None:
            raise RegistryError("the backend hands over no file the controller can read; MLflow needs one")
        expected = request.model.manifest.get("sha256")
        work = self.scratch_dir / request.job_id
        work.mkdir(parents=True, exist_ok=True)
        try:
            copy = work / src.name
            digest = stamp(src, copy, provenance_metadata(request.job_id, request.records))
            if expected and digest != expected:
                raise RegistryError(f"{src}: sha256 {digest[:16]}... differs from the export manifest's "
                                    f"{str(expected)[:16]}...; the file changed after the worker wrote it")
            tags = {URL_TAG: request.job_url, "deepfleet.job_name": request.job_name,
                    "deepfleet.project": request.project}
            if request.model.manifest.get("checkpoint"):
                tags["deepfleet.checkpoint"] = str(request.model.manifest["checkpoint"])
            return register_model(copy, name=request.name, tracking_uri=self.tracking_uri, store_dir=self.store_dir,
                                  tags=tags, description=request.description, once=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
