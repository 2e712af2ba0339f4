"""What a project's jobs may ask of the hosts and clusters they run on: admin-set, checked at submit.

Called by the submit endpoint (`controller.api.jobs`) after the spec parsed and before it is stored;
each refusal is one "<field>: <problem>; <fix>" line and the submit answers 422. Settings hold a
`ProjectPolicy` per project (`DEEPFLEET_POLICY_FILE`, a YAML mapping project -> policy, with "*" for
every other project); an unlisted project gets `ProjectPolicy()`, whose defaults are the safe ones:
the controller's own namespace, the namespace's default service account, no priority class, no
PersistentVolumeClaim, no node selector or toleration beyond the accelerator type, no secret
reference (kubernetes, azureml), any image.

Also here, for every backend: the host-path rules of `controller.confine` (local jobs) and the
factory rule (a factory names the job's own code, never the standard library or deepfleet itself).
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

from deepfleet.controller.confine import factory_error, spec_path_errors
from deepfleet.controller.spec import JobSpec, secret_refs


class ProjectPolicy(BaseModel):
    """Which cluster resources one project's jobs may name (an empty list allows none)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    namespaces: list[str] = []
    """Kubernetes namespaces besides the controller's own (`k8s_namespace`)."""
    service_accounts: list[str] = []
    """`serviceAccountName` values allowed; none: pods run as the namespace's default account."""
    priority_classes: list[str] = []
    """`priorityClassName` values allowed."""
    claims: list[str] = []
    """PersistentVolumeClaims `checkpointClaim` may mount."""
    node_selector_keys: list[str] = []
    """Node-label keys `nodeSelector` may use."""
    tolerations: bool = False
    """Whether `tolerations` may be set at all (they let pods onto tainted, e.g. control-plane, nodes)."""
    image_prefixes: list[str] = Field(default_factory=lambda: [""])
    """Image references must start with one of these (the default [""] allows any image)."""
    image_pull_secrets: list[str] = []
    """`imagePullSecrets` names allowed."""
    secrets: list[str] = []
    """Secrets `env` entries may reference on kubernetes (Secrets in the job's namespace) and azureml
    (secrets of the controller's Key Vault). On local, a project references its own secret store."""


class Policies(BaseModel):
    """The admin's policy table: project name -> ProjectPolicy; "*" is every unlisted project."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    projects: dict[str, ProjectPolicy] = {}

    def for_project(self, project: str) -> ProjectPolicy:
        return self.projects.get(project) or self.projects.get("*") or ProjectPolicy()

    @classmethod
    def load(cls, path: Path | None) -> Policies:
        """From a YAML file `{project: {namespaces: [...], ...}}`; None: the defaults. Raises ValueError."""
        if path is None:
            return cls()
        document = yaml.safe_load(Path(path).read_text()) or {}
        return cls.model_validate({"projects": document})


def _refuse(field: str, value: str, allowed: list[str], what: str) -> str | None:
    if value in allowed:
        return None
    listed = ", ".join(allowed) if allowed else "none"
    return (f"{field}: {what} {value!r} is not allowed for this project (allowed: {listed}); "
            "drop it or ask an admin to allow it")


def submit_errors(spec: JobSpec, *, policy: ProjectPolicy, default_namespace: str,
                  factory_modules: tuple[str, ...]) -> list[str]:
    """Every reason `spec` may not be stored for its project (empty: it may)."""
    s = spec.spec
    errors = spec_path_errors(spec)
    factory = getattr(s.entrypoint, "factory", None)
    if factory is not None and (e := factory_error(factory, allowed=factory_modules)):
        errors.append(e)
    if s.backend != "local":
        for var, ref in secret_refs(spec).items():
            if (e := _refuse(f"spec.env.{var}.secret", ref.secret, policy.secrets, "secret")):
                errors.append(e)
    if s.image is not None and not any(s.image.startswith(p) for p in policy.image_prefixes):
        errors.append(f"spec.image: {s.image!r} is not from a registry this project may use "
                      f"({', '.join(policy.image_prefixes)}); use an allowed image")
    k = s.kubernetes
    if k is None:
        return errors
    checks = [
        ("spec.kubernetes.namespace", k.namespace, [default_namespace, *policy.namespaces], "namespace"),
        ("spec.kubernetes.serviceAccountName", k.service_account_name, policy.service_accounts, "service account"),
        ("spec.kubernetes.priorityClassName", k.priority_class_name, policy.priority_classes, "priority class"),
        ("spec.kubernetes.checkpointClaim", k.checkpoint_claim, policy.claims, "claim"),
    ]
    for field, value, allowed, what in checks:
        if value is not None and (e := _refuse(field, value, allowed, what)):
            errors.append(e)
    for key in k.node_selector:
        if (e := _refuse(f"spec.kubernetes.nodeSelector.{key}", key, policy.node_selector_keys, "node label")):
            errors.append(e)
    for i, secret in enumerate(k.image_pull_secrets):
        if (e := _refuse(f"spec.kubernetes.imagePullSecrets[{i}]", secret, policy.image_pull_secrets, "secret")):
            errors.append(e)
    if k.tolerations and not policy.tolerations:
        errors.append("spec.kubernetes.tolerations: not allowed for this project; drop them or ask an admin "
                      "to allow tolerations")
    return errors
