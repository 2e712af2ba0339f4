"""Register a job's exported model in MLflow's model registry, linked back to its job.

Callers: `deepfleet register MODEL.safetensors --name NAME` (controller/cli_jobs.py) and users'
scripts. The model file must carry its job's provenance (`deepfleet checkpoint export --provenance`):
the registry entry's tags name the job id and the provenance chain's head hash read from the file, so
the entry, the file and the controller's record point at each other. MLflow does the storing: a run
in experiment "deepfleet" holds the file as an artifact, and a model version of registered model NAME
points at it. The default store is local (`sqlite:///<dir>/mlflow.db`, artifacts under `<dir>/artifacts`;
MLflow's plain file store is deprecated); any tracking URI (an MLflow server) works when given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

EXPERIMENT = "deepfleet"
JOB_TAG = "deepfleet.job_id"
HEAD_TAG = "deepfleet.provenance_head"


class RegistryError(ValueError):
    """A model that cannot be registered; the message names the problem and the fix."""


@dataclass(frozen=True)
class Registered:
    name: str
    version: str
    run_id: str
    source: str
    job_id: str
    provenance_head: str


def model_provenance(path: Path) -> dict[str, str]:
    """The deepfleet provenance keys of a safetensors file's metadata (header only; no tensor is read)."""
    try:
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
    except (OSError, ValueError) as e:
        raise RegistryError(f"{path}: not a readable safetensors file ({e}); give the exported model") from None
    meta = header.get("__metadata__") or {}
    if JOB_TAG not in meta or HEAD_TAG not in meta:
        raise RegistryError(f"{path}: carries no job provenance; export it with `deepfleet checkpoint export "
                            "... --provenance provenance.json` first")
    return meta


def default_store(root: Path) -> str:
    return f"sqlite:///{root.resolve() / 'mlflow.db'}"


def register_model(path: str | Path, *, name: str, tracking_uri: str | None = None,
                   registry_uri: str | None = None, store_dir: str | Path = "mlruns") -> Registered:
    """Log `path` as an artifact of a new run and register it as a version of model `name`, tagged with
    its job id and provenance head. `tracking_uri` default: a local store under `store_dir`."""
    from mlflow import MlflowClient

    path = Path(path)
    meta = model_provenance(path)
    root = Path(store_dir)
    if tracking_uri is None:
        root.mkdir(parents=True, exist_ok=True)
        tracking_uri = default_store(root)
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=registry_uri or tracking_uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is not None:
        experiment_id = experiment.experiment_id
    else:
        location = (root.resolve() / "artifacts").as_uri() if tracking_uri.startswith("sqlite:") else None
        experiment_id = client.create_experiment(EXPERIMENT, artifact_location=location)
    tags = {JOB_TAG: meta[JOB_TAG], HEAD_TAG: meta[HEAD_TAG]}
    run = client.create_run(experiment_id, tags=tags, run_name=f"job-{meta[JOB_TAG][:8]}")
    client.log_artifact(run.info.run_id, str(path), artifact_path="model")
    client.set_terminated(run.info.run_id)
    if client.search_registered_models(filter_string=f"name = '{name}'") == []:
        client.create_registered_model(name)
    source = f"{run.info.artifact_uri}/model/{path.name}"
    version = client.create_model_version(name, source=source, run_id=run.info.run_id, tags=tags,
                                          description=f"deepfleet job {meta[JOB_TAG]}")
    return Registered(name=name, version=str(version.version), run_id=run.info.run_id, source=source,
                      job_id=meta[JOB_TAG], provenance_head=meta[HEAD_TAG])
