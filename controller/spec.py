"""JobSpec: the one schema of a training job (`apiVersion: deepfleet/v1`, `kind: TrainingJob`).

The CLI, the REST API, the database, the backend renderers and the controller all validate the same
model. `parse_job_yaml` is the entry point for user text: it turns YAML into a `JobSpec` or raises
`SpecError` whose `.errors` are one line each, "<dotted.path>: <problem>; <fix>". The engine section
(a path or an inline DeepSpeed-style config) is checked with `deepfleet.engine.config.load_config`
at the job's world size, and its errors are re-pathed under `spec.engine.`.

The JSON schema (`JobSpec.model_json_schema()`, printed by `deepfleet schema`) is a public surface,
frozen by a snapshot test. Torch-free: this module imports pydantic, yaml and (lazily) the engine's
torch-free config module only.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from deepfleet.controller.bounds import DocumentTooLarge, check_yaml_node
from deepfleet.worker.spec import (
    MAX_NODES,
    MAX_STEPS,
    MISSING_STEPS,
    Checkpoint,
    Entrypoint,
    ExportDtype,
    FactoryEntrypoint,
    Nodes,
    RestartPolicy,
    Section,
    ServeOptions,
    Text,
)

API_VERSION = "deepfleet/v1"
KIND = "TrainingJob"
SERVING_KIND = "ServingJob"
# Where a serving job's copy of the training checkpoint lives inside its own checkpoint area (local backend;
# kubernetes and azureml point the worker's checkpoint.dir at the read-only mount of the source instead).
SERVED_CHECKPOINT_DIR = "served"

# Backend run names are f"df-{name}-{job_id[:8]}-a{attempt}" and must fit a 63-char DNS-1123 label.
MAX_NAME_LEN = 40
# Every number has a range (the database columns are 32-bit; no real job is near these): MAX_NODES and
# MAX_STEPS live with the shared sections in worker/spec.py.
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# Kubernetes-style label keys: an optional DNS prefix and "/", then a name of up to 63 chars.
LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Kubernetes resource quantities ("2", "500m", "8Gi", "1.5").
QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"
FACTORY_REF = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
# The controller sets these for every worker; a job may not override them.
RESERVED_ENV_PREFIX = "DEEPFLEET_"

Backend = Literal["local", "kubernetes", "azureml"]
Priority = Literal["low", "normal", "high"]


class SpecError(ValueError):
    """A job spec the user must fix; `.errors` holds one "<path>: <problem>; <fix>" line each."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


_Section = Section
"""Base of every spec section (the worker's: unknown keys are errors, YAML camelCase, Python snake_case,
field docstrings as the schema's descriptions)."""


class Metadata(_Section):
    name: Annotated[str, Field(max_length=MAX_NAME_LEN, pattern=DNS_LABEL)]
    """Job name: a DNS-1123 label (lowercase letters, digits, '-') of at most 40 characters."""
    project: Annotated[str, Field(max_length=63, pattern=DNS_LABEL)]
    """The project that owns the job; API tokens are bound to one project."""
    labels: dict[str, Text] = {}
    """Free-form key/value labels (Kubernetes label syntax); `deepfleet ls --label k=v` filters on them."""

    @field_validator("labels")
    @classmethod
    def _labels_are_kubernetes_labels(cls, labels: dict[str, str]) -> dict[str, str]:
        for key, value in labels.items():
            if not LABEL_KEY.match(key):
                raise ValueError(f"label key {key!r} is not a valid label name; use letters, digits, '-', '_', '.'")
            if not LABEL_VALUE.match(value):
                raise ValueError(f"label {key}={value!r}: value must be <= 63 letters, digits, '-', '_', '.'")
        return labels


class Resources(_Section):
    cpu: Annotated[str | None, Field(pattern=QUANTITY)] = None
    """CPU per node as a Kubernetes quantity ("2", "500m")."""
    memory: Annotated[str | None, Field(pattern=QUANTITY)] = None
    """Memory per node as a Kubernetes quantity ("8Gi")."""
    gpu: Annotated[int, Field(ge=0, le=64)] = 0
    """GPUs per node."""
    gpu_type: str | None = None
    """Accelerator type (a node label value on Kubernetes, a VM size hint on Azure ML)."""

    @field_validator("cpu", "memory", mode="before")
    @classmethod
    def _numbers_are_quantities(cls, value: Any) -> Any:
        # YAML reads `cpu: 2` as an int; a quantity is the same thing written as a string.
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        return value


def _nodes_kind(value: Any) -> str:
    return "elastic" if isinstance(value, dict | Nodes) else "fixed"


def _engine_kind(value: Any) -> str | None:
    if value is None:
        return "none"
    return "path" if isinstance(value, str) else "inline" if isinstance(value, dict) else None


class Toleration(_Section):
    """A Kubernetes toleration, as in a pod spec, so the job's pods may run on tainted (e.g. GPU) nodes."""

    key: str | None = None
    """Taint key to tolerate; null with operator Exists tolerates every taint."""
    operator: Literal["Exists", "Equal"] | None = None
    """Exists: any value of `key`; Equal (Kubernetes' default): only `value`."""
    value: str | None = None
    """Taint value to match with operator Equal."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to tolerate; null: every effect."""
    toleration_seconds: Annotated[int | None, Field(ge=0, le=2**31 - 1)] = None
    """NoExecute only: how long the pod stays bound after the taint appears; null: forever."""


class KubernetesOptions(_Section):
    namespace: Annotated[str | None, Field(max_length=63, pattern=DNS_LABEL)] = None
    """Namespace for the job's pods and service; null uses the controller's namespace."""
    node_selector: dict[str, Text] = {}
    """Node labels the job's pods must run on (a pod's nodeSelector)."""
    tolerations: list[Toleration] = []
    """Taints the job's pods tolerate."""
    priority_class_name: str | None = None
    """Kubernetes PriorityClass of the job's pods (preemption order on the cluster)."""
    service_account_name: str | None = None
    """ServiceAccount the pods run as; null: the namespace's default."""
    image_pull_secrets: list[str] = []
    """Names of Secrets used to pull `spec.image` from a private registry."""
    shm_size: Annotated[str | None, Field(pattern=QUANTITY)] = None
    """Size of the /dev/shm memory volume (NCCL and dataloader workers need more than the 64Mi default)."""
    kueue_queue: str | None = None
    """Kueue LocalQueue name; when set, admission is left to Kueue."""
    termination_grace_period_seconds: Annotated[int | None, Field(ge=0, le=86_400)] = None
    """Time between SIGTERM and SIGKILL: must cover one checkpoint at preemption."""
    checkpoint_claim: Annotated[str | None, Field(max_length=253, pattern=DNS_LABEL)] = None
    """A ReadWriteMany PersistentVolumeClaim mounted at `checkpoint.dir` in every pod; the job keeps its
    checkpoints in its own directory there, `<checkpoint.dir>/<project>/<job id>`, so every attempt writes
    to and resumes from the same checkpoints (and a later job naming this one in `resumeFrom` or
    `model.job` mounts that directory read-only)."""


class AzureMLOptions(_Section):
    compute: Annotated[str, Field(min_length=1)]
    """Name of the Azure ML compute cluster."""
    experiment_name: str | None = None
    """Experiment to file the run under; null uses the project name."""
    environment: str | None = None
    """Registered environment ("name:version" or "azureml:name@latest"); null builds one from `image`."""


class SecretRef(_Section):
    """An `env` value taken from a secret at run time; the spec (and every API answer) holds only the name."""

    secret: Annotated[str, Field(max_length=63, pattern=DNS_LABEL)]
    """Name of the secret: in the controller's secret store of the job's project (backend local,
    `deepfleet secret set`), a Kubernetes Secret in the job's namespace (kubernetes) or a secret of the
    controller's Azure Key Vault (azureml). The project's policy says which names it may reference."""
    key: Annotated[str | None, Field(max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")] = None
    """Key inside the Kubernetes Secret (backend kubernetes only); null: `value`."""


SECRET_KEY_DEFAULT = "value"
# Worker variables a job may set in `env` although they carry deepfleet's prefix (they configure the
# worker's side of a contract rather than take it over).
USER_SETTABLE_ENV = frozenset({"DEEPFLEET_CA_BUNDLE", "DEEPFLEET_SERVE_API_KEY"})

MODEL_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class ModelRegistration(_Section):
    """Register the job's model when the job succeeds: node 0 exports the newest complete checkpoint's
    weights to safetensors, and the controller registers that file with the job's provenance: in MLflow's
    model registry (backend local; the controller's tracking URI, a local store by default) or as a model
    asset of the workspace (backend azureml). The entry's tags and description name the job and its URL."""

    name: Annotated[str, Field(min_length=1, max_length=255, pattern=MODEL_NAME)]
    """Registered model name; each successful job adds the next version."""
    dtype: ExportDtype = "fp32"
    """dtype of the exported floating-point tensors (fp32, bf16 or fp16)."""


def _env_kind(value: Any) -> str:
    return "env-secret" if isinstance(value, dict | SecretRef) else "env-value"


EnvValue = Annotated[
    Annotated[Text, Tag("env-value")] | Annotated[SecretRef, Tag("env-secret")],
    Discriminator(_env_kind),
]


def _check_env_names(env: dict[str, str | SecretRef]) -> dict[str, str | SecretRef]:
    for name in env:
        if not ENV_NAME.match(name):
            raise ValueError(f"{name!r} is not a valid environment variable name; use letters, digits and '_'")
        if name.startswith(RESERVED_ENV_PREFIX) and name not in USER_SETTABLE_ENV:
            raise ValueError(f"{name} is set by deepfleet for every worker; drop it or rename it")
    return env


def _backend_problems(spec: TrainingSpec | ServingSpec) -> list[str]:
    """The image and backend sections a spec's backend needs or forbids (training and serving alike)."""
    problems = []
    if spec.backend in ("kubernetes", "azureml") and not spec.image:
        problems.append(f"image: required for backend {spec.backend}; set spec.image to the worker image")
    for section in ("kubernetes", "azureml"):
        if getattr(spec, section) is not None and spec.backend != section:
            problems.append(f"{section}: only applies to backend {section}; remove spec.{section} "
                            f"or set spec.backend: {section}")
    return problems


def _env_key_problems(env: dict[str, str | SecretRef], backend: str) -> list[str]:
    return [f"env.{name}.key: only applies to backend kubernetes (a key inside a Secret); drop key"
            for name, value in env.items()
            if isinstance(value, SecretRef) and value.key is not None and backend != "kubernetes"]


_AZUREML_REQUIRED = "azureml: required for backend azureml; add azureml: {compute: <cluster name>}"


class TrainingSpec(_Section):
    backend: Backend = "local"
    """Where the job runs: local processes, a Kubernetes cluster or Azure ML."""
    image: str | None = None
    """Worker container image; required by kubernetes and azureml, ignored by local."""
    nodes: Annotated[
        Annotated[Annotated[int, Field(ge=1, le=MAX_NODES)], Tag("fixed")] | Annotated[Nodes, Tag("elastic")],
        Discriminator(_nodes_kind),
    ] = 1
    """Number of nodes, or {min, max} for an elastic job."""
    processes_per_node: Annotated[int, Field(ge=1, le=1024)] = 1
    """Training processes per node (GPUs per node on real clusters)."""
    resources: Resources = Resources()
    """What each node asks the cluster for (Kubernetes requests/limits, Azure ML instance type hints)."""
    entrypoint: Entrypoint
    """What runs: a script ({script, args}) or the managed loop over a factory ({factory, args})."""
    engine: Annotated[
        Annotated[str, Tag("path")] | Annotated[dict[str, Any], Tag("inline")] | Annotated[None, Tag("none")],
        Discriminator(
            _engine_kind,
            custom_error_type="engine_kind",
            custom_error_message="give a path to a JSON/YAML config file or the config inline as a mapping",
        ),
    ] = None
    """Engine config: a path to a DeepSpeed-style JSON/YAML file or the config inline; null uses defaults."""
    checkpoint: Checkpoint | None = None
    """Where training checkpoints and resumes from; null: no checkpoints (a restart starts over)."""
    restart_policy: RestartPolicy = RestartPolicy()
    max_steps: Annotated[int | None, Field(ge=1, le=MAX_STEPS)] = None
    """Optimizer steps to train: required for a factory entrypoint (the managed loop's length); a script
    receives it as DEEPFLEET_MAX_STEPS (and `deepfleet.engine.initialize` as its budget)."""
    priority: Priority = "normal"
    """Admission order inside a queue."""
    queue: Annotated[str, Field(max_length=63, pattern=DNS_LABEL)] = "default"
    """Queue whose quota the job counts against."""
    env: dict[str, EnvValue] = {}
    """Extra environment variables for every worker process: a string, or `{secret: <name>}` to take the
    value from a secret when the job starts (never stored in the spec, never shown)."""
    kubernetes: KubernetesOptions | None = None
    """Options for backend kubernetes only."""
    azureml: AzureMLOptions | None = None
    """Options for backend azureml only (required there: the compute cluster)."""
    register_model: ModelRegistration | None = None
    """Register the exported model when the job succeeds (needs `checkpoint`); null: no registration."""

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str | SecretRef]) -> dict[str, str | SecretRef]:
        return _check_env_names(env)

    @model_validator(mode="after")
    def _backend_sections_match(self) -> TrainingSpec:
        problems = _backend_problems(self)
        if self.kubernetes is not None and self.kubernetes.checkpoint_claim:
            if self.checkpoint is None or not self.checkpoint.dir.startswith("/"):
                problems.append("kubernetes.checkpointClaim: mounts at checkpoint.dir, which must be an absolute "
                                "path; set checkpoint: {dir: /checkpoints/<job>} or drop checkpointClaim")
        problems += _env_key_problems(self.env, self.backend)
        if isinstance(self.entrypoint, FactoryEntrypoint) and self.max_steps is None:
            problems.append(MISSING_STEPS.format(key="maxSteps").replace("set maxSteps", "set spec.maxSteps"))
        if self.register_model is not None and self.checkpoint is None:
            problems.append("registerModel: the model is exported from the newest complete checkpoint; set "
                            "checkpoint: {dir: ...} or drop registerModel")
        if self.register_model is not None and self.backend == "kubernetes":
            problems.append("registerModel: not supported on backend kubernetes yet (the controller cannot read "
                            "the pods' checkpoint volume); export with `deepfleet checkpoint export` and run "
                            "`deepfleet register`, or drop registerModel")
        if self.backend == "azureml" and self.azureml is None:
            problems.append(_AZUREML_REQUIRED)
        if problems:
            # One line per field, each "<field>: <problem>"; _format_error puts them under this section's path.
            raise ValueError(_FIELD_LINES + "\n".join(problems))
        return self


class JobSpec(_Section):
    """A training job as the user submits it (`apiVersion: deepfleet/v1`, `kind: TrainingJob`)."""

    model_config = ConfigDict(title="TrainingJob")

    api_version: Literal["deepfleet/v1"]
    """Version of this schema."""
    kind: Literal["TrainingJob"]
    """The document's kind."""
    metadata: Metadata
    """Who owns the job and what it is called."""
    spec: TrainingSpec
    """What to run, where, and how to recover."""

    _engine_configs: dict[int, Any] = PrivateAttr(default_factory=dict)
    """The engine configs `validate_job` built, by world size (so a submit builds each once)."""

    def to_document(self) -> dict[str, Any]:
        """The spec as the YAML/JSON document a user writes (camelCase keys, unset options omitted)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)

    def validated_engine_config(self, world_size: int) -> dict[str, Any] | None:
        """The inline engine config as validation filled it in at `world_size` (None: not validated there)."""
        config = self._engine_configs.get(world_size)
        return None if config is None else config.to_dict()


class ServedModel(_Section):
    """What a ServingJob serves: the newest complete checkpoint of a finished training job of the same
    project (named by job id, never by a path), loaded into the module the training job's factory builds."""

    job: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9-]+$")]
    """Id of a finished TrainingJob of the same project on the same backend; its newest complete checkpoint is
    loaded (at any world size it was saved at): copied into the serving job's own area (local), read where the
    training job's claim directory is mounted read-only (kubernetes) or from its checkpoint folder given as a
    read-only input (azureml)."""
    factory: Annotated[str, Field(pattern=FACTORY_REF)]
    """"package.module:function" that builds the model: the training job's factory (its ManagedJob's model
    is used) or any function of the project's code returning the module."""
    args: dict[str, Any] = {}
    """Keyword arguments for the factory (the training job's, so the shapes match the checkpoint)."""


class ServingSpec(ServeOptions):
    """A ServingJob's spec: the served model, init_inference's options (inherited from the worker's
    ServeOptions, the same model) and where the endpoint runs. One node, one process; it runs until
    cancelled."""

    model: ServedModel
    """The checkpoint to serve and the factory that builds its module."""
    backend: Backend = "local"
    """Where the endpoint runs: a local process, a Kubernetes pod or an Azure ML job."""
    image: str | None = None
    """Worker container image; required by kubernetes and azureml, ignored by local."""
    resources: Resources = Resources()
    """What the serving node asks the cluster for."""
    restart_policy: RestartPolicy = RestartPolicy()
    priority: Priority = "normal"
    """Admission order inside a queue."""
    queue: Annotated[str, Field(max_length=63, pattern=DNS_LABEL)] = "default"
    """Queue whose quota the endpoint counts against (one process)."""
    env: dict[str, EnvValue] = {}
    """Extra environment variables for the serving process (a string, or `{secret: <name>}`)."""
    kubernetes: KubernetesOptions | None = None
    """Options for backend kubernetes only."""
    azureml: AzureMLOptions | None = None
    """Options for backend azureml only (required there: the compute cluster)."""

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str | SecretRef]) -> dict[str, str | SecretRef]:
        return _check_env_names(env)

    @model_validator(mode="after")
    def _backend_sections_match(self) -> ServingSpec:
        problems = _backend_problems(self)
        if self.backend == "azureml" and self.azureml is None:
            problems.append(_AZUREML_REQUIRED)
        if self.kubernetes is not None and self.kubernetes.checkpoint_claim:
            problems.append("kubernetes.checkpointClaim: a serving job reads its checkpoint from the job named "
                            "in model.job; drop checkpointClaim")
        problems += _env_key_problems(self.env, self.backend)
        if problems:
            raise ValueError(_FIELD_LINES + "\n".join(problems))
        return self

    # What the rest of the controller reads of a TrainingSpec, derived (never part of the document).
    @property
    def entrypoint(self) -> FactoryEntrypoint:
        return FactoryEntrypoint(factory=self.model.factory, args=self.model.args)

    @property
    def checkpoint(self) -> Checkpoint:
        return Checkpoint(dir=SERVED_CHECKPOINT_DIR, resume_from=self.model.job)

    @property
    def nodes(self) -> int:
        return 1

    @property
    def processes_per_node(self) -> int:
        return 1

    @property
    def engine(self) -> None:
        return None

    @property
    def max_steps(self) -> None:
        return None

    @property
    def register_model(self) -> None:
        return None

    def serve_options(self) -> ServeOptions:
        """The init_inference options the worker receives."""
        return ServeOptions.model_validate({k: getattr(self, k) for k in ServeOptions.model_fields})


class ServingJob(_Section):
    """An inference endpoint as the user submits it (`apiVersion: deepfleet/v1`, `kind: ServingJob`): the
    checkpoint of a finished training job served at /v1/completions until the job is cancelled."""

    model_config = ConfigDict(title="ServingJob")

    api_version: Literal["deepfleet/v1"]
    """Version of this schema."""
    kind: Literal["ServingJob"]
    """The document's kind."""
    metadata: Metadata
    """Who owns the endpoint and what it is called."""
    spec: ServingSpec
    """What to serve, how and where."""

    def to_document(self) -> dict[str, Any]:
        """The spec as the YAML/JSON document a user writes (camelCase keys, unset options omitted)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)

    def validated_engine_config(self, world_size: int) -> dict[str, Any] | None:
        return None  # init_inference's options are checked by the ServeOptions model itself


AnyJob = JobSpec | ServingJob
"""A stored or submitted job of either kind; both read the same way (`.metadata`, `.spec.backend`, ...)."""


def is_serving(spec: AnyJob) -> bool:
    return isinstance(spec, ServingJob)


def _model_of(document: Any) -> type[JobSpec] | type[ServingJob]:
    return ServingJob if isinstance(document, dict) and document.get("kind") == SERVING_KIND else JobSpec


def node_bounds(spec: JobSpec) -> tuple[int, int]:
    """(min, max) nodes; equal for a fixed-size job."""
    nodes = spec.spec.nodes
    return (nodes.min, nodes.max) if isinstance(nodes, Nodes) else (nodes, nodes)


def job_world_size(spec: JobSpec) -> int:
    """Total training processes at the job's full size (max nodes for an elastic job)."""
    return node_bounds(spec)[1] * spec.spec.processes_per_node


# Marks a cross-field error whose message holds "<field>: <problem>" lines relative to the section.
_FIELD_LINES = "fields:\n"

# Union fields and the branch tags pydantic adds to an error's location; the user wrote no such key.
_UNION_TAGS = {"entrypoint": {"script", "factory"}, "nodes": {"fixed", "elastic"}, "engine": {"path", "inline", "none"}}
_ENV_TAGS = {"env-value", "env-secret"}  # after any variable name, so not keyed by the field

_PATTERN_HINTS = {
    DNS_LABEL: "must be a DNS-1123 label: lowercase letters, digits and '-', starting and ending alphanumeric",
    QUANTITY: "must be a Kubernetes quantity such as \"2\", \"500m\" or \"8Gi\"",
    FACTORY_REF: "must name a callable as 'package.module:function'",
}


def _format_loc(loc: tuple[int | str, ...]) -> str:
    parts: list[str] = []
    previous: int | str | None = None
    for item in loc:
        if item in _ENV_TAGS or (isinstance(previous, str) and item in _UNION_TAGS.get(previous, ())):
            previous = item
            continue
        previous = item
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or "(document)"


def _format_errors(err: dict[str, Any]) -> list[str]:
    msg = err["msg"].removeprefix("Value error, ")
    if msg.startswith(_FIELD_LINES):
        path = _format_loc(tuple(err["loc"]))
        prefix = "" if path == "(document)" else path + "."
        return [prefix + line for line in msg.removeprefix(_FIELD_LINES).splitlines()]
    return [_format_error(err)]


def _format_error(err: dict[str, Any]) -> str:
    path = _format_loc(tuple(err["loc"]))
    kind = err["type"]
    if kind == "extra_forbidden":
        return f"{path}: unknown field; remove it (check the spelling against `deepfleet schema`)"
    if kind == "missing":
        return f"{path}: required field is missing; add it"
    if kind == "string_pattern_mismatch":
        hint = _PATTERN_HINTS.get(err.get("ctx", {}).get("pattern"), err["msg"])
        return f"{path}: {hint}; got {err.get('input')!r}"
    msg = err["msg"].removeprefix("Value error, ")
    if kind.endswith("_kind") or kind == "value_error":
        return f"{path}: {msg}"
    return f"{path}: {msg}; got {err.get('input')!r}"


def _errors_from(exc: ValidationError) -> list[str]:
    # A union field (nodes, engine) reports one error per branch; keep them all, but only once each.
    seen: list[str] = []
    for err in exc.errors():
        for line in _format_errors(err):
            if line not in seen:
                seen.append(line)
    return seen


def _validate_engine(spec: JobSpec, *, base_dir: Path | None, read_files: bool = True) -> list[str]:
    """Check the engine config at the job's world sizes; errors re-pathed under spec.engine."""
    engine = spec.spec.engine
    if engine is None:
        return []
    source: str | Path | dict[str, Any] = engine
    if isinstance(engine, str) and not read_files:
        return ["spec.engine: the server reads no files named in a spec; put the engine config inline "
                "(`deepfleet submit` inlines the file it names)"]
    if isinstance(engine, str):
        path = Path(engine).expanduser()
        if not path.is_absolute():
            path = (base_dir or Path.cwd()) / path
        if not path.is_file():
            return [f"spec.engine: file {engine!r} not found (looked at {path}); give an existing path "
                    "or put the config inline"]
        source = path
    from deepfleet.engine.config import ConfigError, load_config

    low, high = node_bounds(spec)
    per_node = spec.spec.processes_per_node
    errors: list[str] = []
    # An elastic job must be valid at every size it may run at; its two bounds are the extremes.
    for world_size in sorted({low * per_node, high * per_node}):
        try:
            config = load_config(source, world_size=world_size)
            if isinstance(source, dict):
                spec._engine_configs[world_size] = config
        except ConfigError as e:
            suffix = f" (at world size {world_size})" if low != high else ""
            errors.extend(f"spec.engine.{line}{suffix}" for line in e.errors if f"spec.engine.{line}" not in errors)
            break
    return errors


def stored_spec(document: Any) -> AnyJob:
    """A JobSpec (or ServingJob) from a stored document (the database's copy), without re-reading engine
    files; raises SpecError with one line per field (a document stored by an older version may no longer
    validate)."""
    try:
        return _model_of(document).model_validate(document)
    except ValidationError as e:
        raise SpecError(_errors_from(e)) from None


def validate_job(document: Any, *, base_dir: Path | None = None, read_files: bool = True) -> AnyJob:
    """Validate a parsed document (a dict) into a JobSpec (or a ServingJob when `kind: ServingJob`),
    engine config included; raises SpecError.

    `read_files=False` (the server): an engine config given as a path is refused, never opened."""
    if not isinstance(document, dict):
        raise SpecError([f"(document): expected a mapping with apiVersion, kind, metadata, spec; "
                         f"got {type(document).__name__}"])
    kind = document.get("kind")
    if isinstance(kind, str) and kind not in (KIND, SERVING_KIND):
        raise SpecError([f"kind: {kind!r} is not a kind of job; write kind: {KIND} or kind: {SERVING_KIND}"])
    try:
        spec = _model_of(document).model_validate(document)
    except ValidationError as e:
        raise SpecError(_errors_from(e)) from None
    if isinstance(spec, ServingJob):
        return spec
    errors = _validate_engine(spec, base_dir=base_dir, read_files=read_files)
    if errors:
        raise SpecError(errors)
    return spec


# libyaml's C scanner when PyYAML was built with it: the pure-Python one costs ~15 ms per job document.
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _StrictLoader(_SafeLoader):  # type: ignore[misc, valid-type]
    """SafeLoader that rejects duplicate keys (PyYAML keeps the last one silently)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}; keep one of them", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
# `5e-4` is a number, as in the engine's config reader (YAML 1.1 would read it as a string).
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_job_yaml(text: str, *, base_dir: Path | None = None, read_files: bool = True) -> AnyJob:
    """Parse a YAML (or JSON) job document; raises SpecError with one line per problem.

    A relative `spec.engine` path resolves against `base_dir` (default: the working directory).
    """
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            check_yaml_node(node)  # before any object is built: an alias bomb stops here
        document = loader.construct_document(node) if node is not None else None
    except DocumentTooLarge as e:
        raise SpecError([str(e)]) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecError([f"(document): malformed YAML{where}: {problem}; fix the syntax"]) from None
    finally:
        loader.dispose()
    return validate_job(document, base_dir=base_dir, read_files=read_files)


def plain_env(spec: JobSpec) -> dict[str, str]:
    """The spec's `env` entries that are plain values (what the WorkerSpec carries)."""
    return {k: v for k, v in spec.spec.env.items() if isinstance(v, str)}


def secret_refs(spec: JobSpec) -> dict[str, SecretRef]:
    """The spec's `env` entries that reference a secret, by variable name."""
    return {k: v for k, v in spec.spec.env.items() if isinstance(v, SecretRef)}
