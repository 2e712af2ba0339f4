"""The worker's contracts: the WorkerSpec a backend hands every worker process, the exit codes the
controller keys its failure handling on, a pure exit-code classifier, and the Heartbeat and
FailureReport bodies a worker posts back.

Callers: the controller (builds a WorkerSpec from a job, classifies worker exits, validates the
heartbeats it receives), every backend (serializes the spec into `DEEPFLEET_WORKER_SPEC`) and the
worker itself (`worker/cli.py` loads it). This module is torch-free by contract: the controller
imports it, and a test imports it with torch blocked.

Validation follows the project rule: every problem becomes one line `"<dotted.key>: <problem>; <fix>"`
(`WorkerSpecError.errors`), unknown keys are reported by name, never ignored.
"""

from __future__ import annotations

import enum
import json
import os
import re
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

SPEC_ENV = "DEEPFLEET_WORKER_SPEC"
JOB_ID_ENV = "DEEPFLEET_JOB_ID"
ATTEMPT_ENV = "DEEPFLEET_ATTEMPT"
HEARTBEAT_URL_ENV = "DEEPFLEET_HEARTBEAT_URL"
TOKEN_ENV = "DEEPFLEET_TOKEN"
# Admin allow-listed module prefixes an entrypoint factory may name although they are installed packages.
FACTORY_MODULES_ENV = "DEEPFLEET_FACTORY_MODULES"
# Azure ML: the vault and the {VAR: secret name} references the worker resolves before training starts.
KEYVAULT_URL_ENV = "DEEPFLEET_KEYVAULT_URL"
KEYVAULT_SECRETS_ENV = "DEEPFLEET_KEYVAULT_SECRETS"
# A serving worker writes its endpoint's URL (one line) to this file once it listens (local backend).
ENDPOINT_FILE_ENV = "DEEPFLEET_ENDPOINT_FILE"
PORT_FILE_ENV = "DEEPFLEET_RDZV_PORT_FILE"  # where node 0 publishes a port-0 rendezvous port
SERVE_PORT = 8000  # where a serving worker listens in a container (pod, Azure ML node)

SIGNAL_EXIT_BASE = 128
# Every number has a range (the controller's database columns are 32-bit; no real job is near these).
MAX_NODES = 4096
MAX_STEPS = 10**9


# ---------------------------------------------------------------------------------------------- exit codes
class ExitCode(enum.IntEnum):
    """What a worker process's exit status means (DESIGN.md, "Worker exit codes").

    Codes 64..78 follow BSD sysexits where one fits (64 EX_USAGE, 75 EX_TEMPFAIL). A worker killed
    by signal N exits 128+N (the shell convention); `signal_exit_code(N)` builds it.
    """

    SUCCEEDED = 0
    INVALID_SPEC = 64  # spec or engine config invalid: no retry
    USER_ERROR = 65  # the training code raised: retry only if the policy says so
    PREEMPTED = 75  # checkpoint taken at a step boundary, resumable: retry, not counted against the budget
    COMM_FAILURE = 76  # collective/rendezvous timeout or a lost peer: retry
    OOM = 77  # out of memory: no blind retry, the event says what to change


def signal_exit_code(signum: int) -> int:
    """Exit status of a process killed by signal `signum` (128 + N)."""
    return SIGNAL_EXIT_BASE + int(signum)


class FailureClass(str, enum.Enum):
    """How the controller's failure ladder sees one worker exit."""

    SUCCEEDED = "succeeded"
    INVALID_SPEC = "invalid_spec"
    USER_ERROR = "user_error"
    PREEMPTED = "preempted"
    COMM_FAILURE = "comm_failure"
    OOM = "oom"
    NODE_LOST = "node_lost"  # killed by a signal without a checkpoint (node loss, eviction, SIGKILL)
    UNKNOWN = "unknown"


_CODE_CLASS = {
    ExitCode.SUCCEEDED: FailureClass.SUCCEEDED,
    ExitCode.INVALID_SPEC: FailureClass.INVALID_SPEC,
    ExitCode.PREEMPTED: FailureClass.PREEMPTED,
    ExitCode.COMM_FAILURE: FailureClass.COMM_FAILURE,
    ExitCode.OOM: FailureClass.OOM,
}

# Log text that identifies the cause when the exit status alone does not (a generic exit 1 from a
# script, a SIGKILL from the kernel's OOM killer). Matched case-insensitively against the log tail.
_OOM_PATTERNS = re.compile(
    r"out of memory|outofmemoryerror|\bMemoryError\b|cannot allocate memory|can't allocate memory"
    r"|\bOOMKilled\b|oom-kill|\bENOMEM\b",
    re.IGNORECASE,
)
_COMM_PATTERNS = re.compile(
    r"\bnccl\w*\s*(error|timeout)|\bDistBackendError\b|ncclSystemError|ncclInternalError|ncclRemoteError|ncclUnhandledCudaError"
    r"|watchdog caught collective operation timeout|communicator was aborted"
    r"|gloo\b.*(timed out|timeout|connection|closed|refused)|connectFullMesh failed"
    r"|connection (reset|closed) by peer|\bDistNetworkError\b|\bDistStoreError\b"
    r"|Rendezvous(Timeout|Closed|Connection)Error|collective operation timeout",
    re.IGNORECASE,
)


def classify_exit(code: int, *, log_tail: str = "") -> FailureClass:
    """Map a worker's exit status (and the tail of its log) to a FailureClass. Pure.

    The worker's own contract codes (0, 64, 75, 76, 77) are trusted as they are. For a user error
    (65), any other non-zero status, or a signal death, the log tail decides when it names an
    out-of-memory or a communication failure. A negative `code` is Python's `returncode` for a
    signal death (-N) and is read as 128+N.
    """
    if code < 0:
        code = signal_exit_code(-code)
    if code in _CODE_CLASS:
        return _CODE_CLASS[ExitCode(code)]
    if _OOM_PATTERNS.search(log_tail):
        return FailureClass.OOM
    if _COMM_PATTERNS.search(log_tail):
        return FailureClass.COMM_FAILURE
    if code > SIGNAL_EXIT_BASE:
        return FailureClass.NODE_LOST
    if 0 < code < SIGNAL_EXIT_BASE:
        return FailureClass.USER_ERROR
    return FailureClass.UNKNOWN


# ---------------------------------------------------------------------------------------------- the spec
class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Section(BaseModel):
    """Base of the sections the JobSpec shares with the WorkerSpec (`controller/spec.py` embeds them):
    unknown keys are errors; the job's YAML writes camelCase (`everySteps`), the worker's JSON and
    Python snake_case (`every_steps`), and both validate; field docstrings are the schema's descriptions."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        populate_by_name=True,
        alias_generator=to_camel,
        use_attribute_docstrings=True,
    )


def _scalar_to_str(value: Any) -> Any:
    # YAML reads `50`, `1.5` or `true` as numbers and booleans where the job means text
    # (`args: ["--steps", 50]`, `labels: {version: 2}`); take them as the text the user wrote.
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float):
        return str(value)
    return value


Text = Annotated[str, BeforeValidator(_scalar_to_str)]
"""A string field that also accepts a YAML number or boolean, as its text."""


class ScriptEntrypoint(Section):
    """A DeepSpeed-style user script, run in every training process as `__main__` with `args`."""

    script: Annotated[str, Field(min_length=1)]
    """Path of the Python training script (absolute, or relative to the worker's working directory)."""
    args: list[Text] = []
    """Command-line arguments passed to the script."""
    deepspeed: bool = False
    """Run an unmodified DeepSpeed script, as `deepfleet run` does: in the training processes
    `import deepspeed` is deepfleet's engine, and `--local_rank=<n>` is appended to `args` as
    DeepSpeed's launcher passes it. `deepspeed.initialize(args=...)` without `--deepspeed_config` takes
    the job's engine config."""


def _legacy_factory_args(value: Any) -> Any:
    # Factory args were once a list of "key=value" strings. They are a mapping now, with typed values;
    # the old form is rejected (not translated) so one spelling remains, and the error is the rewrite.
    if not isinstance(value, list):
        return value
    pairs = []
    for item in value:
        key, sep, raw = str(item).partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"factory args are a mapping of keyword arguments, got the list {value!r}; "
                             "write args: {name: value, ...}")
        pairs.append(f"{key}: {raw}")
    steps = [p for p in pairs if p.startswith("max_steps:")]
    hint = f" and move {steps[0]} to spec.maxSteps" if steps else ""
    rest = ", ".join(p for p in pairs if not p.startswith("max_steps:"))
    raise ValueError(f"factory args are a mapping now, not key=value strings; write args: {{{rest}}}{hint}")


class FactoryEntrypoint(Section):
    """A `package.module:function` the managed loop (worker/train.py) calls as `function(**args)`; it
    returns a `ManagedJob` (model, data, loss)."""

    factory: str
    """"package.module:function", imported from the worker's working directory."""
    args: Annotated[dict[str, Any], BeforeValidator(_legacy_factory_args)] = {}
    """Keyword arguments for the factory, with their YAML/JSON types (`{d_model: 64, lr: 3e-4}`)."""

    @field_validator("factory")
    @classmethod
    def _module_colon_function(cls, v: str) -> str:
        mod, sep, fn = v.partition(":")
        if not sep or not mod or not fn or not all(p.isidentifier() for p in [*mod.split("."), *fn.split(".")]):
            raise ValueError(f'{v!r} is not "package.module:function"; write it like "examples.gpt.factories:build"')
        return v

    @field_validator("args")
    @classmethod
    def _no_step_budget(cls, v: dict[str, Any]) -> dict[str, Any]:
        if "max_steps" in v:
            raise ValueError("max_steps is the job's step budget, not a factory argument; "
                             "move it to spec.maxSteps")
        return v


def _entrypoint_kind(value: Any) -> str | None:
    if isinstance(value, Mapping):
        if "script" in value:
            return "script"
        if "factory" in value:
            return "factory"
        return None
    return "script" if isinstance(value, ScriptEntrypoint) else "factory" if isinstance(value, FactoryEntrypoint) else None


Entrypoint = Annotated[
    Annotated[ScriptEntrypoint, Tag("script")] | Annotated[FactoryEntrypoint, Tag("factory")],
    Discriminator(
        _entrypoint_kind,
        custom_error_type="entrypoint_kind",
        custom_error_message="give either {script: path, args: [...]} or "
        "{factory: 'package.module:function', args: {...}}",
    ),
]


class Nodes(Section):
    """Elastic node range: training runs with any node count in [min, max] (torchrun --nnodes MIN:MAX)."""

    min: Annotated[int, Field(ge=1, le=MAX_NODES)] = 1
    """Fewest nodes the job may run on (an elastic job shrinks and reshards down to this)."""
    max: Annotated[int, Field(ge=1, le=MAX_NODES)] = 1
    """Most nodes the job asks for."""

    @model_validator(mode="after")
    def _ordered(self) -> Nodes:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is greater than max ({self.max}); set min <= max")
        return self


class Checkpoint(Section):
    """Where and how often training checkpoints (layout: DESIGN.md, "Checkpoint layout"). The managed
    loop saves by itself; a script gets `dir` as DEEPFLEET_CHECKPOINT_DIR."""

    dir: Annotated[str, Field(min_length=1)]
    """Checkpoint directory shared by all nodes (a shared path or mounted volume); every attempt resumes
    from its newest complete checkpoint."""
    every_steps: Annotated[int | None, Field(ge=1, le=MAX_STEPS)] = None
    """Save every N optimizer steps; null saves only on preemption and at the end."""
    keep_last: Annotated[int | None, Field(ge=1, le=10_000)] = None
    """Keep only the newest N complete checkpoints; null keeps all."""
    resume_from: Annotated[str | None, Field(max_length=64, pattern=r"^[A-Za-z0-9-]+$")] = None
    """Id of an earlier job of the same project and backend whose newest complete checkpoint this job starts
    from; null starts fresh (a job never picks up another job's checkpoints by name)."""


class RestartPolicy(Section):
    """How failures are retried: two knobs, attempts (the controller starts the job again on fresh
    processes, possibly elsewhere, resuming from the newest checkpoint) and in-place restarts (a node's
    elastic agent restarts its process group inside one attempt, without rescheduling). The only place
    that holds the restart defaults: the reconciler, the lifecycle and the worker all read them here."""

    max_restarts: Annotated[int, Field(ge=0, le=10_000)] = 3
    """New attempts after retryable failures (preemptions do not count). 0: the first failure is final,
    with neither a new attempt nor an in-place restart."""
    in_place_restarts: Annotated[int, Field(ge=0, le=10_000)] = 3
    """In-place restarts of the process group per attempt, capped at maxRestarts. Never used for a
    failure the policy does not retry (invalid spec, out of memory, a user error without
    retryOnUserError): those end the attempt at once."""
    backoff_seconds: Annotated[float, Field(ge=0, le=86_400, allow_inf_nan=False)] = 5.0
    """Wait before a new attempt; doubles on each consecutive failure."""
    retry_on_user_error: bool = False
    """Also retry when the training code raised (worker exit 65); off by default, as a bug repeats."""

    @property
    def in_place_budget(self) -> int:
        """In-place restarts the elastic agent may make in one attempt."""
        return min(self.in_place_restarts, self.max_restarts)

    def retries(self, failure: FailureClass) -> bool:
        """Whether a failure of this class may be retried (in place or by a new attempt)."""
        if failure in (FailureClass.SUCCEEDED, FailureClass.INVALID_SPEC, FailureClass.OOM):
            return False
        return failure is not FailureClass.USER_ERROR or self.retry_on_user_error


class RendezvousSpec(_Model):
    """torch.distributed.elastic c10d rendezvous. The endpoint is derived from the backend's environment
    (see worker/rendezvous.py) when left unset."""

    backend: Literal["c10d"] = Field("c10d", description="Rendezvous backend (c10d: a TCPStore on one node).")
    endpoint: str | None = Field(None, description='"host:port" of the rendezvous store; None: derived.')
    port: int = Field(29400, ge=0, le=65535, description="Port when the endpoint is derived; 0: node 0 binds a "
                      "free one and publishes it in DEEPFLEET_RDZV_PORT_FILE (one host only, see worker/rendezvous.py).")
    run_id: str | None = Field(None, description='Rendezvous run id; None: "<job_id>-<attempt>".')
    join_timeout_s: float = Field(600.0, gt=0, description="How long a node waits for the group to form.")
    last_call_timeout_s: float = Field(
        30.0, gt=0, description="Extra wait for more nodes once `nodes.min` have joined."
    )
    close_timeout_s: float = Field(60.0, gt=0, description="How long to wait for a closing rendezvous.")
    keep_alive_interval_s: int = Field(5, ge=1, description="Seconds between a node's rendezvous keep-alives.")
    keep_alive_max_attempts: int = Field(
        3, ge=1, description="Missed keep-alives after which a node counts as lost (and leaves the group)."
    )
    pg_timeout_s: float = Field(300.0, gt=0, description="Timeout of collectives in the training process group.")

    @field_validator("endpoint")
    @classmethod
    def _host_port(cls, v: str | None) -> str | None:
        if v is None:
            return v
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f'{v!r} is not "host:port"; write it like "10.0.0.4:29400"')
        return v


class HeartbeatSpec(_Model):
    """Rank 0 posts a Heartbeat to `url`; any rank may post a FailureReport to `failure_url`."""

    url: str | None = Field(None, description="Heartbeat endpoint (http/https); None: no heartbeats.")
    failure_url: str | None = Field(None, description="Failure-report endpoint; None: none are posted.")
    token: str | None = Field(None, description="Bearer token scoped to this job (or DEEPFLEET_TOKEN).")
    interval_s: float = Field(10.0, gt=0, description="Seconds between heartbeats.")
    timeout_s: float = Field(2.0, gt=0, description="HTTP timeout of one post.")

    @field_validator("url", "failure_url")
    @classmethod
    def _http(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError(f"{v!r} is not an http(s) URL; write it like https://controller:8000/...")
        return v


class PreemptionSpec(_Model):
    """SIGTERM or a notice file makes every rank checkpoint at the next step boundary and exit 75."""

    notice_file: str | None = Field(
        None, description="Path whose appearance means preemption is coming (cloud spot notices)."
    )
    grace_period_s: float = Field(30.0, gt=0, description="Seconds between the notice and a forced stop.")


# Where node 0 writes a succeeded job's exported model: `<dir>/model.safetensors` beside `export.json`
# (an ExportManifest), with <dir> = `<checkpoint.dir>/export` unless `ModelExport.dir` names another.
EXPORT_SUBDIR = "export"
EXPORT_MODEL_FILE = "model.safetensors"
EXPORT_MANIFEST = "export.json"
ExportDtype = Literal["fp32", "bf16", "fp16"]


class ModelExport(_Model):
    """When training succeeds, node 0 exports the model weights of the newest complete checkpoint to one
    safetensors file (worker/export.py), for the controller to register (`spec.registerModel`)."""

    dtype: ExportDtype = Field("fp32", description="dtype of the exported floating-point tensors.")
    dir: str | None = Field(None, description="Folder to write into; None: <checkpoint.dir>/export. "
                            "`deepfleet-worker --export-dir` sets it (Azure ML: the job's model output).")


class ExportManifest(_Model):
    """`export.json`: what node 0 exported, or why it could not (then only `error` and the ids are set)."""

    job_id: str
    attempt: int = Field(ge=0)
    file: str | None = Field(None, description="The model file's name inside the export folder.")
    checkpoint: str | None = Field(None, description="Tag of the checkpoint the weights come from.")
    global_steps: int | None = Field(None, ge=0)
    dtype: ExportDtype | None = None
    tensors: int | None = Field(None, ge=0)
    bytes: int | None = Field(None, ge=0)
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$", description="sha256 of the whole file (hex).")
    error: str | None = Field(None, max_length=4000, description="Why nothing was exported.")


class WeightQuant(Section):
    """Weight-only quantization of the served decoder's linear layers (init_inference's `quant.weight`)."""

    num_bits: Literal[8, 4] = 8
    """8: int8 codes with one scale per output channel; 4: int4 codes with a scale and zero per group."""
    group_size: Annotated[int, Field(ge=2, le=65_536)] = 64
    """Input columns per int4 group."""


ServeDtype = Literal["fp32", "bf16", "fp16"]


class ServeOptions(Section):
    """How a serving worker runs `init_inference` and the completions endpoint (engine/inference/serve.py).
    The names are init_inference's (DeepSpeed's), in the spec's camelCase."""

    dtype: ServeDtype = "fp32"
    """Compute and weight dtype of the served model."""
    quant: WeightQuant | None = None
    """Weight-only quantization; null: none."""
    max_out_tokens: Annotated[int, Field(ge=2, le=1_048_576)] = 1024
    """Positions per sequence in the static KV cache (prompt + generated tokens)."""
    max_batch_size: Annotated[int, Field(ge=1, le=1024)] = 16
    """Sequences decoded together (KV-cache slots); more requests wait for a free slot."""
    replace_with_kernel_inject: bool = False
    """Route norms, rotary and activations through deepfleet's fused kernels and fuse the projections."""
    compile: bool = False
    """Run the decode step under torch.compile at static shapes (`engine.compile()`): faster steps on a busy
    endpoint, after a compile of tens of seconds per key bucket (the first requests wait for it)."""
    model_name: Annotated[str, Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")] = "deepfleet"
    """The model name clients send in requests (`/v1/models` lists it)."""


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class WorkerSpec(_Model):
    """Everything one worker needs to run its share of a training job. The sections it shares with the
    JobSpec (entrypoint, nodes, checkpoint, restart policy, max_steps) are the same models."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    job_id: Annotated[str, Field(min_length=1)]
    """The controller's job id."""
    attempt: Annotated[int, Field(ge=0)] = 0
    """Attempt number (new attempts start a new rendezvous)."""
    entrypoint: Entrypoint
    engine_config: dict[str, Any] | str | None = None
    """Engine (DeepSpeed-style) config: an inline dict or a path to .json/.yaml."""
    platform: Literal["auto", "local", "kubernetes", "azureml"] = "auto"
    """Whose environment names the node rank and master address; auto: detect."""
    nodes: Nodes = Nodes()
    processes_per_node: Annotated[int, Field(ge=1)] = 1
    """Training processes per node (one per GPU)."""
    rendezvous: RendezvousSpec = RendezvousSpec()
    checkpoint: Checkpoint | None = None
    """Where training checkpoints; null: no checkpoints."""
    restart: RestartPolicy = RestartPolicy()
    monitor_interval_s: Annotated[float, Field(gt=0)] = 1.0
    """How often the elastic agent checks its processes."""
    heartbeat: HeartbeatSpec = HeartbeatSpec()
    preemption: PreemptionSpec = PreemptionSpec()
    max_steps: Annotated[int | None, Field(ge=1, le=MAX_STEPS)] = None
    """Optimizer steps to train: the managed loop's length, a script's budget (DEEPFLEET_MAX_STEPS)."""
    log_every_steps: Annotated[int, Field(ge=1)] = 10
    """Managed loop: print a progress line every N steps."""
    export: ModelExport | None = None
    """Export the model when training succeeds (needs `checkpoint`); null: no export."""
    env: dict[str, str] = {}
    """Extra environment for training processes."""
    serve: ServeOptions | None = None
    """Serve the checkpoint instead of training: the entrypoint's factory builds the model, the newest
    complete checkpoint under `checkpoint.dir` is loaded into it, and node 0 answers /v1/completions."""
    resume_dir: str | None = None
    """A (read-only) directory holding the checkpoints `checkpoint.resumeFrom` names, where the backend
    mounted them (Kubernetes: the source job's claim; Azure ML: its checkpoint folder as an input, set by
    `deepfleet-worker --resume-dir`). When `checkpoint.dir` holds no complete checkpoint, the worker copies
    the newest complete one from here into it before training starts; nothing is written here. None: the
    backend already put it in `checkpoint.dir` (local) or there is none."""
    serve_address: str | None = None
    """"host:port" the serving endpoint listens on (port 0: any free port, reported through
    DEEPFLEET_ENDPOINT_FILE); None: 0.0.0.0:SERVE_PORT (a container's)."""

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        bad = [k for k in v if not _ENV_NAME.match(k)]
        if bad:
            raise ValueError(f"invalid variable name(s) {bad}; use letters, digits and _")
        return v

    @model_validator(mode="after")
    def _factory_needs_steps(self) -> WorkerSpec:
        if isinstance(self.entrypoint, FactoryEntrypoint) and self.max_steps is None and self.serve is None:
            raise ValueError(MISSING_STEPS.format(key="max_steps"))
        return self

    @model_validator(mode="after")
    def _serve_needs_a_checkpoint(self) -> WorkerSpec:
        if self.serve is not None and (self.checkpoint is None or not isinstance(self.entrypoint, FactoryEntrypoint)):
            raise ValueError("serve: needs checkpoint (the weights) and a factory entrypoint (the model); set both "
                             "or drop serve")
        if self.serve_address is not None:
            host, sep, port = self.serve_address.rpartition(":")
            if not sep or not host or not port.isdigit() or int(port) > 65535:
                raise ValueError(f'serve_address: {self.serve_address!r} is not "host:port"; write it like '
                                 '"127.0.0.1:0"')
        return self

    @model_validator(mode="after")
    def _export_needs_checkpoints(self) -> WorkerSpec:
        if self.export is not None and self.checkpoint is None:
            raise ValueError("export: the model is exported from the newest complete checkpoint; set checkpoint "
                             "or drop export")
        return self

    @property
    def export_dir(self) -> Path | None:
        """Where node 0 writes the exported model (None: no export)."""
        if self.export is None or self.checkpoint is None:
            return None
        return Path(self.export.dir) if self.export.dir else Path(self.checkpoint.dir) / EXPORT_SUBDIR

    @property
    def run_id(self) -> str:
        """The rendezvous run id: one per attempt, so a new attempt never joins a stale group."""
        return self.rendezvous.run_id or f"{self.job_id}-{self.attempt}"


MISSING_STEPS = "{key}: a factory entrypoint needs it; set {key} to the optimizer steps to train"


# ---------------------------------------------------------------------------------------------- reports
class DatasetFingerprint(_Model):
    """One data source a run trains on: its URI and digest ("sha256:<hex>" or the user's own)."""

    uri: str = Field(min_length=1, max_length=2048)
    digest: str = Field(min_length=1, max_length=256)


class Heartbeat(_Model):
    """What rank 0 posts every `heartbeat.interval_s` (DESIGN.md, "Heartbeat")."""

    step: int = Field(ge=0, description="Optimizer steps completed.")
    loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    tokens_per_s: float | None = Field(None, ge=0, description="Training throughput over the last interval.")
    last_complete_checkpoint: str | None = Field(None, description="Tag of the newest COMPLETE checkpoint.")
    mfu: float | None = Field(None, ge=0, description="Model FLOPs utilization of the newest step (0..1).")
    checkpoint_s: float | None = Field(None, ge=0, description="Seconds this attempt has spent saving checkpoints.")
    dp_epsilon: float | None = Field(None, ge=0, description="Epsilon spent so far under DP-SGD (at dp_delta).")
    dp_delta: float | None = Field(None, gt=0, lt=1, description="The delta of dp_epsilon.")
    dp_accountant: Literal["rdp", "prv"] | None = Field(None, description="The accountant of dp_epsilon.")
    torch_version: str | None = Field(None, max_length=64, description="torch.__version__ in the training process.")
    datasets: list[DatasetFingerprint] = Field(
        [], max_length=64, description="Data sources the training code reported (engine.record_dataset).")
    time: datetime = Field(default_factory=lambda: datetime.now(timezone.utc), description="UTC, when taken.")


class FailureReport(_Model):
    """What any rank may post before it exits abnormally (JSON key `class`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, serialize_by_alias=True)

    rank: int = Field(ge=0)
    failure_class: FailureClass = Field(alias="class")
    message: str = Field(max_length=4000, description="One line: what failed and where.")


# ---------------------------------------------------------------------------------------------- loading
class WorkerSpecError(ValueError):
    """An invalid worker spec. `.errors` holds one line per problem: "<dotted.key>: <problem>; <fix>"."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        super().__init__("invalid worker spec: " + " | ".join(errors))


def _dotted(loc: tuple[Any, ...]) -> str:
    # Drop the union tag pydantic puts in the location ("entrypoint.script.args" -> "entrypoint.args").
    if len(loc) > 2 and loc[0] == "entrypoint" and loc[1] in ("script", "factory"):
        loc = (loc[0], *loc[2:])
    return ".".join(str(p) for p in loc) or "<spec>"


def _one_line(err: dict[str, Any]) -> str:
    where = _dotted(tuple(err["loc"]))
    kind = err["type"]
    if kind == "extra_forbidden":
        return f"{where}: unknown key; remove it or check its spelling"
    if kind == "missing":
        return f"{where}: required; set it"
    msg = str(err["msg"]).removeprefix("Value error, ")
    if not err["loc"] and re.match(r"^[\w.]+: ", msg):  # a cross-field check names its own key
        return msg
    return f"{where}: {msg}" if ";" in msg else f"{where}: {msg}; fix the value"


def parse_worker_spec(data: Mapping[str, Any], *, environ: Mapping[str, str] | None = None) -> WorkerSpec:
    """Validate a spec dict. Worker-environment variables fill the keys the spec leaves unset:
    DEEPFLEET_JOB_ID -> job_id, DEEPFLEET_ATTEMPT -> attempt, DEEPFLEET_HEARTBEAT_URL -> heartbeat.url,
    DEEPFLEET_TOKEN -> heartbeat.token (the token is kept out of the stored spec)."""
    env = os.environ if environ is None else environ
    if not isinstance(data, Mapping):
        raise WorkerSpecError([f"<spec>: expected a JSON object, got {type(data).__name__}; write {{...}}"])
    def fill(target: dict[str, Any], key: str, var: str) -> None:
        if target.get(key) is None and env.get(var):
            target[key] = env[var]

    raw: dict[str, Any] = dict(data)
    fill(raw, "job_id", JOB_ID_ENV)
    fill(raw, "attempt", ATTEMPT_ENV)
    hb = raw.get("heartbeat")
    if isinstance(hb, Mapping) or hb is None:
        hb = dict(hb or {})
        fill(hb, "url", HEARTBEAT_URL_ENV)
        fill(hb, "token", TOKEN_ENV)
        if hb:
            raw["heartbeat"] = hb
    try:
        return WorkerSpec.model_validate(raw)
    except ValidationError as e:
        raise WorkerSpecError([_one_line(err) for err in e.errors()]) from None


def load_worker_spec(source: str | os.PathLike[str] | None = None, *, environ: Mapping[str, str] | None = None
                     ) -> WorkerSpec:
    """Load a spec from JSON text, a .json/.yaml file, or (source None) `DEEPFLEET_WORKER_SPEC`,
    which holds either JSON text or a path."""
    env = os.environ if environ is None else environ
    where = "<spec>"
    if source is None:
        where = SPEC_ENV
        if not env.get(SPEC_ENV):
            raise WorkerSpecError([f"<spec>: none given; pass --spec PATH or set {SPEC_ENV} to JSON or a path"])
        source = env[SPEC_ENV]
    text = os.fspath(source)
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise WorkerSpecError([f"{where}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
                                   "; fix the JSON"]) from None
    else:
        path = Path(text)
        if not path.is_file():
            raise WorkerSpecError([f"<spec>: file {text!r} does not exist; pass the path of a .json/.yaml spec"])
        try:
            body = path.read_text()
            data = yaml.safe_load(body) if path.suffix in (".yaml", ".yml") else json.loads(body)
        except (json.JSONDecodeError, yaml.YAMLError) as e:
            raise WorkerSpecError([f"<spec>: {text} is not valid {path.suffix[1:] or 'JSON'} ({e}); fix the file"
                                   .replace("\n", " ")]) from None
    return parse_worker_spec(data, environ=env)
