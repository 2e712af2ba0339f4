"""Controller settings: database URL, request limits, tokens, backend selection.

Built by the server entry point (`deepfleet server`) and by tests, then passed to
`create_app(settings)`, the session factory and the reconciler; there is no module-level settings
object. `Settings.from_env()` reads `DEEPFLEET_*` variables and lets explicit keyword overrides
(command-line flags) win. Plain pydantic rather than pydantic-settings: the env mapping is a dozen
lines and keeps the base install one dependency lighter.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

ENV_PREFIX = "DEEPFLEET_"
# Other names the Helm chart (charts/deepfleet) sets for the same fields; the field's own name wins.
ENV_ALIASES = {"DB_URL": "database_url", "BACKEND": "backends", "RECONCILE_INTERVAL": "reconcile_interval_s",
               "PUBLIC_URL": "controller_url"}

_LISTS = {"backends", "local_env_passthrough", "factory_modules", "local_project_users", "old_secrets"}  # comma-separated in the environment


def default_data_dir(environ: Mapping[str, str] | None = None) -> Path:
    """`$XDG_DATA_HOME/deepfleet` or `~/.local/share/deepfleet` (the embedded default's home)."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_DATA_HOME") or str(Path(env.get("HOME", str(Path.home()))) / ".local" / "share")
    return Path(base) / "deepfleet"


class SettingsError(ValueError):
    """Invalid controller settings; `.errors` holds one "<DEEPFLEET_VAR or field>: <problem>; <fix>" each."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


class Settings(BaseModel):
    """Everything the controller process is configured with (env `DEEPFLEET_<FIELD>` in upper case)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    data_dir: Path = Field(default_factory=default_data_dir)
    """Home of the embedded database and the local backend's logs."""
    database_url: str | None = None
    """SQLAlchemy URL (postgresql+psycopg://... in production); None: SQLite at <data_dir>/deepfleet.db."""
    logs_dir: Path | None = None
    """Where backends write `<logs_dir>/<run name>/node-<i>.log`; None: <data_dir>/logs."""
    backends: list[Literal["local", "kubernetes", "azureml"]] = ["local"]
    """Backends this controller runs (env: comma-separated); a job naming another is refused at submission."""
    k8s_namespace: str = Field("default", max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    """Namespace the Kubernetes backend runs jobs in (a job's `spec.kubernetes.namespace` overrides it)."""
    max_request_bytes: int = Field(1_048_576, ge=1024)
    """Largest request body accepted; bigger bodies get 413."""
    token_ttl_days: float | None = Field(90.0, gt=0)
    """Default lifetime of API tokens created through POST /v1/tokens; None: no expiry."""
    token_cache_s: float = Field(5.0, ge=0, le=300)
    """Seconds an API process trusts a token it verified without looking it up again: a token revoked
    through another process (or in the database) stops working within this time, at once in the process
    that revoked it; 0 looks every token up on every request."""
    secret: SecretStr = Field(default_factory=lambda: SecretStr(secrets.token_urlsafe(32)))
    """Key of the job-scoped worker tokens (HMAC); set it explicitly when several replicas serve one DB."""
    old_secrets: list[SecretStr] = []
    """Earlier values of `secret`, newest first (comma-separated), kept during a rotation: job tokens made
    under them still verify and stored secrets still decrypt until `deepfleet db rotate-keys` has
    re-encrypted them and the jobs started before the rotation have ended (docs/security.md)."""
    admin_token: SecretStr | None = None
    """A bootstrap admin token ("dft_<id>_<secret>") ensured at start for `admin_project`."""
    admin_project: str = "default"
    """Project of the bootstrap admin token."""
    controller_url: str = "http://127.0.0.1:8000"
    """Base URL workers use to reach this controller (heartbeats)."""
    reconcile_interval_s: float = Field(2.0, gt=0)
    """Seconds between reconciler passes."""
    lease_seconds: float = Field(30.0, gt=0)
    """How long a replica's claim on a job (or the scheduler lease) lasts without renewal."""
    replica_id: str = Field(default_factory=lambda: f"controller-{secrets.token_hex(4)}")
    """Name this replica claims jobs under."""
    migrate_on_start: bool = True
    """Run `alembic upgrade head` when the server starts (the Helm chart runs it as a hook instead)."""
    max_inflight_requests: int = Field(32, ge=1, le=1024)
    """API requests handled at once; the thread pool and the database pool are sized from it, and
    requests past it wait up to `queue_timeout_s`, then get 429 with Retry-After."""
    api_processes: int = Field(1, ge=1, le=64)
    """Processes answering the API on one socket (`deepfleet server --api-processes`); the reconcilers
    run in the first only. `max_inflight_requests` is shared out among them."""
    queue_timeout_s: float = Field(10.0, gt=0, le=300)
    """How long a request waits for a free slot before the 429."""
    log_max_bytes: int = Field(16 * 1_048_576, ge=1)
    """Largest log tail the API returns in one response."""
    jobs_dir: Path | None = None
    """Local backend: root of the job areas `<jobs_dir>/<project>/<job id>/`; None: <data_dir>/jobs."""
    local_user: str | None = "nobody"
    """Local backend, when the controller runs as root: the unprivileged user jobs run as (env
    DEEPFLEET_LOCAL_USER; empty keeps root, which lets any job act as the controller)."""
    local_project_users: list[str] = []
    """Local backend, when root: `project=user` pairs (comma-separated; a user name or a bare uid) so each
    project's jobs run as their own user and cannot see another project's processes or files."""
    local_env_passthrough: list[str] = ["PATH", "LANG", "LC_ALL", "TZ", "OMP_NUM_THREADS"]
    """Local backend: the controller's variables a job's processes also get (comma-separated); nothing
    else of the controller's environment reaches a job."""
    policy_file: Path | None = None
    """YAML table of what each project's jobs may use on clusters (namespaces, service accounts, priority
    classes, claims, node labels, images; see `controller.policy`); None: the safe defaults for all."""
    factory_modules: list[str] = []
    """Module prefixes an `entrypoint.factory` may name besides the job's own code (comma-separated,
    admin-set); the standard library and deepfleet's own packages are refused otherwise."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking (and registry) URI where local jobs' models are registered (`spec.registerModel`;
    env also MLFLOW_TRACKING_URI); None: a local store under <data_dir>/mlflow."""

    @field_validator("backends")
    @classmethod
    def _some_backend(cls, backends: list[str]) -> list[str]:
        if not backends:
            raise ValueError("no backend enabled; list at least one of local, kubernetes, azureml")
        return list(dict.fromkeys(backends))

    @property
    def db_url(self) -> str:
        """The effective database URL."""
        return self.database_url or f"sqlite:///{self.data_dir / 'deepfleet.db'}"

    @property
    def jobs_root(self) -> Path:
        """The effective root of the local backend's job areas."""
        return self.jobs_dir or self.data_dir / "jobs"

    @property
    def run_as(self) -> str | None:
        """The user local jobs run as: `local_user` when the controller is root, else the controller's own."""
        return self.local_user if self.local_user and os.geteuid() == 0 else None

    @property
    def project_users(self) -> dict[str, str]:
        """`local_project_users` as a mapping, when the controller is root (else none apply)."""
        if os.geteuid() != 0:
            return {}
        return dict(pair.split("=", 1) for pair in self.local_project_users)

    @field_validator("local_project_users")
    @classmethod
    def _pairs(cls, pairs: list[str]) -> list[str]:
        for pair in pairs:
            project, sep, user = pair.partition("=")
            if not sep or not project or not user:
                raise ValueError(f"{pair!r} is not project=user; write pairs like alpha=df-alpha,beta=60002")
        return pairs

    @property
    def mlflow_store_dir(self) -> Path:
        """The local MLflow store (used when `mlflow_tracking_uri` is None)."""
        return self.data_dir / "mlflow"

    @property
    def logs_root(self) -> Path:
        """The effective logs directory."""
        return self.logs_dir or self.data_dir / "logs"

    def old_secret_values(self) -> tuple[str, ...]:
        """`old_secrets` as plain strings (empty entries dropped)."""
        return tuple(v for v in (s.get_secret_value().strip() for s in self.old_secrets) if v)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from `DEEPFLEET_*` variables; keyword `overrides` (flags) win over the environment.

        Raises SettingsError naming the variable and the fix.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            key = ENV_PREFIX + name.upper()
            if key in env and env[key] != "":
                values[name] = env[key].split(",") if name in _LISTS else env[key]
            elif key in env and name == "local_user":
                values[name] = None  # DEEPFLEET_LOCAL_USER= (empty): run jobs as the controller's user
        for alias, name in ENV_ALIASES.items():
            if name not in values and env.get(ENV_PREFIX + alias):
                values[name] = env[ENV_PREFIX + alias].split(",") if name in _LISTS else env[ENV_PREFIX + alias]
        if "database_url" not in values and env.get("DATABASE_URL"):
            values["database_url"] = env["DATABASE_URL"]
        if "mlflow_tracking_uri" not in values and env.get("MLFLOW_TRACKING_URI"):
            values["mlflow_tracking_uri"] = env["MLFLOW_TRACKING_URI"]
        if "data_dir" not in values:
            values["data_dir"] = default_data_dir(env)
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            lines = []
            for err in e.errors():
                field = str(err["loc"][0]) if err["loc"] else "settings"
                where = ENV_PREFIX + field.upper() if field in values and field not in overrides else field
                msg = err["msg"].removeprefix("Value error, ")
                hint = "unknown setting; remove it" if err["type"] == "extra_forbidden" else f"{msg}; fix the value"
                lines.append(f"{where}: {hint}")
            raise SettingsError(lines) from None
