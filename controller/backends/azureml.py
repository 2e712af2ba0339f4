"""The Azure ML backend: one run = one Azure ML command job with the PyTorch distribution.

Called by `controller.reconciler` through the `Backend` protocol; built by the server (`connect` makes an
`MLClient` from the workspace coordinates and a credential, `DefaultAzureCredential` unless one is given).
This module is the only place that imports `azure.ai.ml` / `azure.core`; their errors are translated
here into `BackendError` (transient for throttling, 5xx and connection failures).

A run is `command(...)` with: the Azure job name = our deterministic run name (so a resubmission finds
the same job: submit GETs first, and a name that exists with our job id is success); `instance_count`
= the job's nodes; `distribution: PyTorch` with `process_count_per_instance: 1` - Azure starts *one*
`deepfleet-worker` per node and sets MASTER_ADDR / MASTER_PORT / NODE_RANK / WORLD_SIZE for it, and the
worker launches `processesPerNode` training processes under torchrun's elastic agent (Azure starting N
workers per node would start N x N processes); the worker image as an anonymous environment (or the
registered `spec.azureml.environment`); the compute target; the WorkerSpec and the submission env as
environment variables; the experiment (`spec.azureml.experimentName`, else the project), a display name
and tags linking back to our job.

Secrets: an Azure ML command job has no field that takes a Key Vault reference for an environment
variable (its `environment_variables` are plain text, readable by anyone who can read the job), and
Azure's documented way for training jobs is that the job reads the secret from Key Vault itself. So
an `env: {VAR: {secret: name}}` entry is sent as a *reference*: `DEEPFLEET_KEYVAULT_URL` (the
controller's vault, `DEEPFLEET_AZUREML_KEY_VAULT`) and `DEEPFLEET_KEYVAULT_SECRETS` (JSON
`{VAR: secret name}`), and the job runs with the compute's managed identity
(`identity: {type: managed}`); the worker resolves them before training starts
(`deepfleet.worker.keyvault`). The identity needs "Key Vault Secrets User" on that vault.

Status mapping (Azure's job statuses -> RunPhase): NotStarted, Queued, Preparing, Provisioning, Starting,
Paused -> PENDING; Running, Finalizing, CancelRequested, NotResponding -> RUNNING (not over yet);
Completed -> SUCCEEDED; Failed, Canceled -> FAILED. Azure reports no per-node exit codes through the job
API; a status message of the form "... exited with status code N" is classified with `classify_exit`,
otherwise the class is UNKNOWN.

Model registration (`spec.registerModel`): the command job gets a read-write mounted `uri_folder` output
`model` and the worker runs as `deepfleet-worker --export-dir ${{outputs.model}}`, so node 0 exports the
model into it; when the job completed, `AzureMLModelRegistry` registers
`azureml://jobs/<run>/outputs/model/paths/model.safetensors` as a `custom_model` asset of the workspace
(`ml_client.models.create_or_update`), the next version of the name, tagged with the job id, its URL and
the provenance head. The controller does not read the output, so the file carries the job id, attempt
and checkpoint (the worker's metadata), not the chain; the chain's head is in the asset's tags and
properties. A version already tagged with the job is adopted (a lost commit never registers twice).

Checkpoints: a training job with a `checkpoint` section gets a read-write mounted `uri_folder` output
`checkpoints` at a fixed folder of the workspace's datastore, `deepfleet/<project>/<job id>/checkpoints`
(`checkpoint_uri`; the datastore is the backend's `datastore`, the workspace's default blob store unless
set), and the worker runs with `--checkpoint-dir ${{outputs.checkpoints}}`, so every attempt of the job
(each its own Azure job) writes to and resumes from the same folder. A job that starts from another
job's checkpoint (`checkpoint.resumeFrom`, a ServingJob's `model.job`; the controller validated at submit
that the source ran on Azure ML with a checkpoint, `controller.sources`) gets the source's folder as a
read-only mounted `uri_folder` input `checkpoint`: a serving job runs with `--checkpoint-dir
${{inputs.checkpoint}}` (it loads the newest complete checkpoint there and writes nothing), a training job
with `--resume-dir ${{inputs.checkpoint}}` (the worker copies that checkpoint into its own output first).

Logs: node N's log is the run's `user_logs/std_log_process_N.txt` (one process per instance, as above).
The SDK's public `jobs.stream` prints every log to stdout until the job ends, so `logs` takes the same
path through the SDK's own pieces instead: the run-history client of `ml_client.jobs` lists the run's
log files (`get_run_details(...).log_files`, SAS URLs) and `download_text_from_url` reads one, through
the client's own HTTP pipeline (credential, retries, transport). Following re-reads the file every
`log_poll_s` and yields what is new until the run is over.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator, Mapping
from typing import Any

from azure.ai.ml import Input, MLClient, Output, PyTorchDistribution, command
from azure.ai.ml.constants import AssetTypes
from azure.ai.ml.entities import Environment, ManagedIdentityConfiguration, Model
from azure.ai.ml.exceptions import MlException
from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    HttpResponseError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
)

from deepfleet.controller.backends.base import BackendError, Observation, RunPhase, Submission
from deepfleet.controller.registry import ExportedModel, Registered, RegistrationRequest, RegistryError
from deepfleet.controller.spec import JobSpec, node_bounds, secret_refs
from deepfleet.worker.spec import (
    EXPORT_MODEL_FILE,
    KEYVAULT_SECRETS_ENV,
    KEYVAULT_URL_ENV,
    SPEC_ENV,
    FailureClass,
    classify_exit,
)

WORKER_COMMAND = "deepfleet-worker"
PHASES: dict[str, RunPhase] = {
    "NotStarted": RunPhase.PENDING,
    "Queued": RunPhase.PENDING,
    "Preparing": RunPhase.PENDING,
    "Provisioning": RunPhase.PENDING,
    "Starting": RunPhase.PENDING,
    "Paused": RunPhase.PENDING,
    "Running": RunPhase.RUNNING,
    "Finalizing": RunPhase.RUNNING,
    "CancelRequested": RunPhase.RUNNING,
    "NotResponding": RunPhase.RUNNING,
    "Completed": RunPhase.SUCCEEDED,
    "Failed": RunPhase.FAILED,
    "Canceled": RunPhase.FAILED,
}
TAG_JOB_ID = "deepfleet.job-id"
TAG_ATTEMPT = "deepfleet.attempt"
TAG_RUN = "deepfleet.run"
TAG_JOB_URL = "deepfleet.job-url"
TAG_HEAD = "deepfleet.provenance-head"
MODEL_OUTPUT = "model"  # the command job's output node 0 exports into (spec.registerModel)
CHECKPOINT_OUTPUT = "checkpoints"  # a training job's own checkpoints (read-write)
CHECKPOINT_INPUT = "checkpoint"  # the checkpoints of the job resumeFrom / model.job names (read-only)
DEFAULT_DATASTORE = "workspaceblobstore"  # every workspace's default blob datastore
_EXIT = re.compile(r"exit(?:ed)? (?:with )?(?:status |exit )?code[: ]+(-?\d+)", re.IGNORECASE)


def connect(subscription_id: str, resource_group: str, workspace: str, *, credential: Any = None,
            **client_kwargs: Any) -> MLClient:
    """An MLClient for the workspace (no network call until used). `client_kwargs` go to azure-core
    (`transport=`, `retry_total=`...). azure-core retries throttling and 5xx ten times with backoff by
    default; one retry is kept here so a call stays short - the reconciler retries transient errors on
    its next pass."""
    client_kwargs.setdefault("retry_total", 1)
    if credential is None:
        from azure.identity import DefaultAzureCredential

        credential = DefaultAzureCredential()
    return MLClient(credential, subscription_id, resource_group, workspace, **client_kwargs)


WORKSPACE_ENV = ("AZURE_SUBSCRIPTION_ID", "AZURE_RESOURCE_GROUP", "AZUREML_WORKSPACE")
KEY_VAULT_ENV = "DEEPFLEET_AZUREML_KEY_VAULT"
DATASTORE_ENV = "DEEPFLEET_AZUREML_DATASTORE"


def from_env(environ: Mapping[str, str], **client_kwargs: Any) -> AzureMLBackend:
    """The backend for the workspace named by AZURE_SUBSCRIPTION_ID, AZURE_RESOURCE_GROUP and
    AZUREML_WORKSPACE (credentials: DefaultAzureCredential), the checkpoints on DEEPFLEET_AZUREML_DATASTORE
    (default: the workspace's default blob store). Raises BackendError naming what is missing."""
    missing = [k for k in WORKSPACE_ENV if not environ.get(k)]
    if missing:
        raise BackendError(f"azureml: set {', '.join(missing)} to the workspace the controller submits to",
                           transient=False)
    return AzureMLBackend(connect(*(environ[k] for k in WORKSPACE_ENV), **client_kwargs),
                          key_vault_url=environ.get(KEY_VAULT_ENV) or None,
                          datastore=environ.get(DATASTORE_ENV) or DEFAULT_DATASTORE)


def translate(e: Exception, what: str) -> BackendError:
    """The BackendError for an SDK exception: transient for 429, 5xx and connection failures."""
    if isinstance(e, ClientAuthenticationError):
        return BackendError(f"azureml: {what}: authentication failed ({_first_line(e)}); check the credential",
                            transient=False)
    if isinstance(e, HttpResponseError):
        status = e.status_code or 0
        transient = status in (408, 429) or status >= 500
        return BackendError(f"azureml: {what}: HTTP {status}: {_first_line(e)}", transient=transient)
    if isinstance(e, ServiceRequestError | ServiceResponseError):
        return BackendError(f"azureml: {what}: cannot reach Azure ({_first_line(e)})", transient=True)
    return BackendError(f"azureml: {what}: {_first_line(e)}", transient=False)


def _first_line(e: Exception) -> str:
    text = getattr(e, "message", None) or str(e)
    return text.strip().splitlines()[0] if text.strip() else type(e).__name__


def checkpoint_uri(project: str, job_id: str, *, datastore: str = DEFAULT_DATASTORE) -> str:
    """The datastore folder of a job's checkpoints (the same for every attempt of the job)."""
    return f"azureml://datastores/{datastore}/paths/deepfleet/{project}/{job_id}/checkpoints"


def _checkpoint_io(sub: Submission, *, datastore: str) -> tuple[dict[str, Input], dict[str, Output], list[str]]:
    """(inputs, outputs, worker options) of the run's checkpoints (see the module docstring). Raises
    ValueError for a resumeFrom whose source is not an Azure ML job's checkpoint folder."""
    checkpoint, serving = sub.worker_spec.checkpoint, sub.worker_spec.serve is not None
    inputs: dict[str, Input] = {}
    outputs: dict[str, Output] = {}
    options: list[str] = []
    if checkpoint is None:
        return inputs, outputs, options
    if not serving:
        outputs[CHECKPOINT_OUTPUT] = Output(type=AssetTypes.URI_FOLDER, mode="rw_mount", path=checkpoint_uri(
            sub.spec.metadata.project, sub.job_id, datastore=datastore))
        options += ["--checkpoint-dir", f"${{{{outputs.{CHECKPOINT_OUTPUT}}}}}"]
    if checkpoint.resume_from is not None:
        source = sub.checkpoint_source
        if source is None or source.job_id != checkpoint.resume_from or source.backend != "azureml" or not source.dir:
            raise ValueError(f"checkpoint.resumeFrom: job {checkpoint.resume_from!r} kept no checkpoints in this "
                             "workspace; name an azureml job that had a checkpoint section")
        inputs[CHECKPOINT_INPUT] = Input(type=AssetTypes.URI_FOLDER, mode="ro_mount", path=checkpoint_uri(
            source.project, source.job_id, datastore=datastore))
        options += ["--checkpoint-dir" if serving else "--resume-dir", f"${{{{inputs.{CHECKPOINT_INPUT}}}}}"]
    return inputs, outputs, options


def command_job(sub: Submission, *, key_vault_url: str | None = None, datastore: str = DEFAULT_DATASTORE) -> Any:
    """The Azure ML command job of one attempt (an `azure.ai.ml` Command node, not yet submitted).
    Raises ValueError for a secret reference without a configured Key Vault, or a checkpoint source
    this workspace does not hold."""
    s = sub.spec.spec
    options = s.azureml
    if options is None:
        raise ValueError("spec.azureml: required for backend azureml; add azureml: {compute: <cluster name>}")
    nodes = node_bounds(sub.spec)[1]
    if options.environment:
        env: Any = options.environment if options.environment.startswith("azureml:") else f"azureml:{options.environment}"
    else:
        env = Environment(image=s.image)
    variables = {
        **sub.env,
        SPEC_ENV: json.dumps(sub.worker_spec.model_dump(mode="json", exclude_none=True), sort_keys=True),
        "DEEPFLEET_NNODES": str(nodes),
    }
    refs = secret_refs(sub.spec)
    if refs:
        if not key_vault_url:
            raise ValueError("spec.env references secrets but the controller has no Key Vault; set "
                             "DEEPFLEET_AZUREML_KEY_VAULT to the vault URL (https://<name>.vault.azure.net)")
        variables[KEYVAULT_URL_ENV] = key_vault_url
        variables[KEYVAULT_SECRETS_ENV] = json.dumps({var: ref.secret for var, ref in sorted(refs.items())})
    inputs, outputs, flags = _checkpoint_io(sub, datastore=datastore)
    if sub.worker_spec.export is not None:
        outputs[MODEL_OUTPUT] = Output(type=AssetTypes.URI_FOLDER, mode="rw_mount")
        flags += ["--export-dir", f"${{{{outputs.{MODEL_OUTPUT}}}}}"]
    return command(
        name=sub.name,
        # Azure mounts the inputs and outputs on every node and substitutes their paths into the command.
        command=" ".join([WORKER_COMMAND, *flags]),
        inputs=inputs or None,
        outputs=outputs or None,
        environment=env,
        compute=options.compute,
        instance_count=nodes,
        distribution=PyTorchDistribution(process_count_per_instance=1),
        environment_variables=variables,
        experiment_name=options.experiment_name or sub.spec.metadata.project,
        display_name=f"{sub.spec.metadata.name} (attempt {sub.attempt})",
        description=f"deepfleet job {sub.job_id}, attempt {sub.attempt}",
        tags={TAG_JOB_ID: sub.job_id, TAG_ATTEMPT: str(sub.attempt), TAG_RUN: sub.name,
              "deepfleet.job-name": sub.spec.metadata.name, "deepfleet.project": sub.spec.metadata.project},
        identity=ManagedIdentityConfiguration() if refs else None,
    )


def observation(status: str | None, *, message: str = "") -> Observation:
    """The Observation for an Azure job status (see the module docstring's table)."""
    if status is None:
        return Observation(RunPhase.NOT_FOUND, message="no such Azure ML job")
    phase = PHASES.get(status)
    if phase is None:
        return Observation(RunPhase.PENDING, message=f"unknown Azure ML status {status!r}")
    if phase is RunPhase.SUCCEEDED:
        return Observation(phase, failure_class=FailureClass.SUCCEEDED, message=status)
    if phase is RunPhase.FAILED:
        found = _EXIT.search(message)
        if status == "Canceled":
            fc = FailureClass.UNKNOWN
        elif found:
            fc = classify_exit(int(found.group(1)), log_tail=message)
        else:
            fc = classify_exit(1, log_tail=message) if message else FailureClass.UNKNOWN
            fc = fc if fc is not FailureClass.USER_ERROR else FailureClass.UNKNOWN
        codes = {0: int(found.group(1))} if found else {}
        return Observation(phase, exit_codes=codes, failure_class=fc, message=f"{status}: {message}".rstrip(": "))
    return Observation(phase, message=status)


class AzureMLBackend:
    """Runs jobs as Azure ML command jobs in the workspace of `ml_client`."""

    name = "azureml"

    def __init__(self, ml_client: MLClient, *, log_poll_s: float = 5.0, key_vault_url: str | None = None,
                 datastore: str = DEFAULT_DATASTORE) -> None:
        """`key_vault_url`: the vault `env` secret references name secrets of (None: none allowed);
        `datastore`: the workspace datastore that holds the jobs' checkpoint folders."""
        self.ml_client = ml_client
        self.log_poll_s = log_poll_s
        self.key_vault_url = key_vault_url
        self.datastore = datastore

    def _get(self, name: str) -> Any | None:
        try:
            return self.ml_client.jobs.get(name)
        except ResourceNotFoundError:
            return None
        except (AzureError, MlException) as e:
            raise translate(e, f"get job {name}") from e

    def submit(self, sub: Submission) -> None:
        existing = self._get(sub.name)
        if existing is not None:
            owner = (existing.tags or {}).get(TAG_JOB_ID)
            if owner != sub.job_id:
                raise BackendError(f"azureml: job {sub.name} exists and belongs to job {owner!r}, not {sub.job_id}",
                                   transient=False)
            return
        try:
            job = command_job(sub, key_vault_url=self.key_vault_url, datastore=self.datastore)
        except ValueError as e:
            raise BackendError(f"azureml: {e}", transient=False) from e
        try:
            self.ml_client.jobs.create_or_update(job)
        except (AzureError, MlException) as e:
            raise translate(e, f"create job {sub.name}") from e

    def observe(self, name: str) -> Observation:
        job = self._get(name)
        if job is None:
            return observation(None)
        return observation(_status(job), message=_status_message(job))

    def cancel(self, name: str) -> None:
        job = self._get(name)
        if job is None or PHASES.get(_status(job)) in (RunPhase.SUCCEEDED, RunPhase.FAILED):
            return
        try:
            # The cancel POST is the one call; Azure then moves the job CancelRequested -> Canceled on its own
            # (observe reports it), so the long-running-operation poller is not waited on.
            self.ml_client.jobs.begin_cancel(name)
        except ResourceNotFoundError:
            return
        except (AzureError, MlException) as e:
            raise translate(e, f"cancel job {name}") from e

    def exported_model(self, run_name: str, *, job_id: str, spec: JobSpec) -> ExportedModel:
        """The model file in run `run_name`'s model output (uploaded by Azure when the job completed). The
        controller cannot read that output's export.json, so nothing is checked before registering."""
        return ExportedModel(uri=f"azureml://jobs/{run_name}/outputs/{MODEL_OUTPUT}/paths/{EXPORT_MODEL_FILE}")

    def model_registry(self) -> AzureMLModelRegistry:
        """Where this workspace's succeeded jobs' models are registered: its own model assets."""
        return AzureMLModelRegistry(self.ml_client)

    def logs(self, name: str, *, node: int = 0, tail: int | None = None, follow: bool = False) -> Iterator[str]:
        if self._get(name) is None:
            raise BackendError(f"azureml: no job {name}", transient=False)
        sent = None  # lines of the file already yielded (None: nothing read yet)
        while True:
            status, text = self._log_text(name, node)
            if text is None and (not follow or PHASES.get(status) in (RunPhase.SUCCEEDED, RunPhase.FAILED)):
                raise BackendError(f"azureml: job {name} has no log for node {node} (yet); its status is {status}",
                                   transient=False)
            lines = (text or "").splitlines(keepends=True)
            if sent is None:
                sent = max(0, len(lines) - tail) if tail is not None else 0
            yield from lines[sent:]
            sent = max(sent, len(lines))
            if not follow or PHASES.get(status) in (RunPhase.SUCCEEDED, RunPhase.FAILED):
                return
            time.sleep(self.log_poll_s)

    def _log_text(self, name: str, node: int) -> tuple[str, str | None]:
        """(run status, node's log text or None when the run has no such file yet)."""
        from azure.ai.ml._utils.utils import download_text_from_url

        wanted = re.compile(rf"^user_logs/std_log_process_0*{node}\.txt$")
        try:
            details = self.ml_client.jobs._runs_operations.get_run_details(name)
            url = next((u for key, u in sorted((details.log_files or {}).items()) if wanted.match(key)), None)
            text = download_text_from_url(url, self.ml_client.jobs._requests_pipeline) if url else None
        except (AzureError, MlException) as e:
            raise translate(e, f"read log of {name}") from e
        return str(details.status), text


def _status(job: Any) -> str:
    """The job's status as Azure spells it (the SDK returns a str enum, or a plain str)."""
    return str(getattr(job.status, "value", job.status))


def _status_message(job: Any) -> str:
    """What Azure says about a finished job, when the SDK exposes it (errors are in `properties`)."""
    props = getattr(job, "properties", None) or {}
    for key in ("azureml.failureReason", "error", "FailureReason", "azureml.runErrorMessage"):
        if props.get(key):
            return str(props[key])
    return ""


class AzureMLModelRegistry:
    """Registers a succeeded job's exported model as a model asset of the workspace
    (`ml_client.models.create_or_update(Model(...))`, type custom_model, the file in the job's model output),
    tagged with the job id, its URL and the provenance head; the next version of the name each job."""

    kind = "azureml"

    def __init__(self, ml_client: MLClient) -> None:
        self.ml_client = ml_client

    def register(self, request: RegistrationRequest) -> Registered:
        if request.model.uri is None:
            raise RegistryError("no Azure ML address for the exported model; Azure ML registers job outputs only")
        try:
            for existing in self._versions(request.name):
                if (existing.tags or {}).get(TAG_JOB_ID) == request.job_id:  # a try whose commit was lost
                    return self._registered(existing, request)
            tags = {TAG_JOB_ID: request.job_id, TAG_JOB_URL: request.job_url, TAG_HEAD: request.head,
                    "deepfleet.job-name": request.job_name, "deepfleet.project": request.project}
            model = Model(name=request.name, path=request.model.uri, type=AssetTypes.CUSTOM_MODEL,
                          description=request.description, tags=tags, properties={TAG_HEAD: request.head})
            created = self.ml_client.models.create_or_update(model)
        except HttpResponseError as e:
            error = translate(e, f"register model {request.name}")
            if error.transient:
                raise error from e
            raise RegistryError(str(error)) from e
        except (AzureError, MlException) as e:
            raise translate(e, f"register model {request.name}") from e
        return self._registered(created, request)

    def _versions(self, name: str) -> list[Any]:
        try:
            return list(self.ml_client.models.list(name=name))
        except ResourceNotFoundError:
            return []

    @staticmethod
    def _registered(model: Any, request: RegistrationRequest) -> Registered:
        return Registered(name=model.name, version=str(model.version), run_id="", source=str(model.path),
                          job_id=request.job_id, provenance_head=(model.tags or {}).get(TAG_HEAD, request.head),
                          uri=f"azureml:{model.name}:{model.version}")
