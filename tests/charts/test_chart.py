"""The Helm chart, checked with the real `helm` binary: strict lint, rendering for default and
production-like values at several Kubernetes versions, validation of every rendered object against the
upstream OpenAPI schemas (kubernetes-validate, strict), and assertions on the fields that matter —
probes, non-root security, the DB Secret wiring, the migration hook, and RBAC limited to exactly what the
Kubernetes backend uses."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "deepfleet"
KUBE_VERSIONS = ["1.30.0", "1.33.0"]
DEFAULT = CHART / "ci" / "default-values.yaml"
PRODUCTION = CHART / "ci" / "production-values.yaml"


def _helm() -> str:
    found = shutil.which("helm", path=os.pathsep.join([str(ROOT / ".ci" / "bin"), os.environ.get("PATH", "")]))
    if not found:
        pytest.fail("helm is not installed: .ci/test.sh puts it in .ci/bin (run `make test`)")
    return found


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([_helm(), *args], capture_output=True, text=True, timeout=120)


def render(values: Path, *, kube_version: str = "1.33.0", extra: tuple[str, ...] = ()) -> list[dict]:
    proc = helm("template", "df", str(CHART), "--namespace", "ml", "-f", str(values),
                "--kube-version", kube_version, *extra)
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


@pytest.mark.parametrize("values", [DEFAULT, PRODUCTION], ids=["default", "production"])
def test_lint_strict_is_clean(values: Path) -> None:
    proc = helm("lint", "--strict", str(CHART), "-f", str(values))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout


def render_defaults(*extra: str, kube_version: str = "1.33.0") -> list[dict]:
    proc = helm("template", "df", str(CHART), "--namespace", "ml", "--kube-version", kube_version, *extra)
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_the_default_install_needs_no_values_and_validates(kube_version: str) -> None:
    docs = render_defaults(kube_version=kube_version)
    for doc in docs:
        kubernetes_validate.validate(doc, kube_version, strict=True)
    (deploy,) = by_kind(docs, "Deployment")
    (pvc,) = by_kind(docs, "PersistentVolumeClaim")
    (config,) = by_kind(docs, "ConfigMap")
    pod = deploy["spec"]["template"]["spec"]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    # a trial install: one replica, SQLite on the chart's volume, migrated by the controller at start
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"] == {"type": "Recreate"}
    assert env["DEEPFLEET_DATABASE_URL"]["value"] == "sqlite:////var/lib/deepfleet/deepfleet.db"
    assert {"name": "data", "persistentVolumeClaim": {"claimName": pvc["metadata"]["name"]}} in pod["volumes"]
    assert config["data"]["DEEPFLEET_MIGRATE_ON_START"] == "true"
    assert config["data"]["DEEPFLEET_DATA_DIR"] == "/var/lib/deepfleet"
    assert not by_kind(docs, "Job")  # no migration hook: it could not mount the volume before the pod


def test_the_admin_token_lives_in_a_secret_and_helm_test_uses_it() -> None:
    docs = render_defaults()
    admin = next(d for d in by_kind(docs, "Secret") if d["metadata"]["name"].endswith("-admin"))
    assert re.fullmatch(r"dft_[0-9a-f]{12}_[A-Za-z0-9]{40}", admin["stringData"]["token"])
    (deploy,) = by_kind(docs, "Deployment")
    env = {e["name"]: e for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["DEEPFLEET_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": admin["metadata"]["name"],
                                                                       "key": "token"}
    (smoke,) = by_kind(docs, "Pod")
    assert smoke["metadata"]["annotations"]["helm.sh/hook"] == "test"
    smoke_env = {e["name"]: e for e in smoke["spec"]["containers"][0]["env"]}
    assert smoke_env["DEEPFLEET_API_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == admin["metadata"]["name"]
    assert "/readyz" in smoke["spec"]["containers"][0]["args"][0]


def test_the_embedded_database_refuses_more_replicas_with_the_fix() -> None:
    proc = helm("template", "df", str(CHART), "--set", "replicaCount=2")
    assert proc.returncode != 0
    assert "replicaCount" in proc.stderr and "database.url" in proc.stderr


def test_production_values_use_the_external_database_and_its_migration_hook() -> None:
    docs = render(PRODUCTION)
    assert not by_kind(docs, "PersistentVolumeClaim") and by_kind(docs, "Job")
    (config,) = by_kind(docs, "ConfigMap")
    assert config["data"]["DEEPFLEET_MIGRATE_ON_START"] == "false"


def test_the_chart_readme_lists_every_value() -> None:
    whole = {"resources", "podSecurityContext", "securityContext"}  # Kubernetes objects, documented as one

    def leaves(tree: dict, prefix: str = "") -> list[str]:
        out = []
        for key, value in tree.items():
            path = f"{prefix}{key}"
            nested = isinstance(value, dict) and value and path not in whole
            out += leaves(value, path + ".") if nested else [path]
        return out

    readme = (CHART / "README.md").read_text()
    missing = [key for key in leaves(yaml.safe_load((CHART / "values.yaml").read_text())) if f"`{key}`" not in readme]
    assert not missing, f"charts/deepfleet/README.md does not document {missing}"


def test_values_schema_rejects_unknown_keys() -> None:
    proc = helm("template", "df", str(CHART), "-f", str(DEFAULT), "--set", "replicas=3")
    assert proc.returncode != 0
    assert "replicas" in proc.stderr


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("values", [DEFAULT, PRODUCTION], ids=["default", "production"])
def test_rendered_objects_validate_against_upstream_schemas(values: Path, kube_version: str) -> None:
    docs = render(values, kube_version=kube_version)
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding",
                                          "ConfigMap", "Job"}
    for doc in docs:
        kubernetes_validate.validate(doc, kube_version, strict=True)


def test_deployment_probes_security_and_db_secret() -> None:
    docs = render(DEFAULT)
    (deploy,) = by_kind(docs, "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    (ctr,) = pod["containers"]
    assert ctr["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert ctr["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert ctr["securityContext"]["allowPrivilegeEscalation"] is False
    assert ctr["securityContext"]["readOnlyRootFilesystem"] is True
    db = next(e for e in ctr["env"] if e["name"] == "DEEPFLEET_DATABASE_URL")
    (secret,) = [s for s in by_kind(docs, "Secret") if not s["metadata"]["name"].endswith("-admin")]
    assert db["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]
    assert secret["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    key = next(e for e in ctr["env"] if e["name"] == "DEEPFLEET_SECRET")["valueFrom"]["secretKeyRef"]
    assert key["name"] == secret["metadata"]["name"] and len(secret["stringData"][key["key"]]) == 48


def test_configmap_names_are_controller_settings() -> None:
    """Every DEEPFLEET_* variable the chart sets is a setting the controller reads."""
    from deepfleet.controller.settings import ENV_PREFIX, Settings

    (cm,) = by_kind(render(DEFAULT), "ConfigMap")
    known = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    assert set(cm["data"]) - known == set()
    settings = Settings.from_env(cm["data"])
    assert settings.backends == ["kubernetes"] and settings.migrate_on_start is False


def test_existing_secret_is_used_and_none_created() -> None:
    docs = render(PRODUCTION)
    # the database Secret is the user's; only the generated admin token's Secret is the chart's
    assert [s["metadata"]["name"] for s in by_kind(docs, "Secret")] == ["df-deepfleet-admin"]
    (deploy,) = by_kind(docs, "Deployment")
    env = deploy["spec"]["template"]["spec"]["containers"][0]["env"]
    ref = next(e for e in env if e["name"] == "DEEPFLEET_DATABASE_URL")["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "deepfleet-db", "key": "url"}
    assert deploy["spec"]["replicas"] == 2
    (ingress,) = by_kind(docs, "Ingress")
    assert ingress["spec"]["tls"][0]["secretName"] == "deepfleet-tls"


def test_migration_hook_runs_before_install_and_upgrade() -> None:
    (job,) = by_kind(render(DEFAULT), "Job")
    ann = job["metadata"]["annotations"]
    assert ann["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert int(ann["helm.sh/hook-weight"]) > -10  # after the hook Secret it reads
    assert job["spec"]["template"]["spec"]["containers"][0]["args"] == ["db", "upgrade"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"


# What the Kubernetes backend does: create/observe/delete Jobs and headless Services, read pods and their
# logs, read events, and hold a lease for leader work. Anything beyond this is a finding.
ALLOWED_RBAC = {
    ("batch", "jobs"): {"create", "get", "list", "watch", "delete"},
    ("", "pods"): {"get", "list", "watch"},
    ("", "pods/log"): {"get"},
    ("", "services"): {"create", "get", "list", "watch", "delete"},
    ("", "secrets"): {"create", "get", "delete"},  # the worker token of each run; never list or watch
    ("", "events"): {"get", "list", "watch"},
    ("coordination.k8s.io", "leases"): {"create", "get", "update"},
    ("networking.k8s.io", "networkpolicies"): {"create"},  # each run's peers-only policy; the Job owns it
}


@pytest.mark.parametrize("values", [DEFAULT, PRODUCTION], ids=["default", "production"])
def test_rbac_grants_exactly_the_backend_verbs(values: Path) -> None:
    docs = render(values)
    assert by_kind(docs, "ClusterRole") == [] and by_kind(docs, "ClusterRoleBinding") == []
    (role,) = by_kind(docs, "Role")
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                assert "*" not in res and "*" not in rule["verbs"] and group != "*"
                granted.setdefault((group, res), set()).update(rule["verbs"])
    assert granted == ALLOWED_RBAC
    (binding,) = by_kind(docs, "RoleBinding")
    expected_ns = "training" if values == PRODUCTION else "ml"
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == expected_ns
    (sa,) = by_kind(docs, "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "ml"}]


def test_tls_serves_the_secrets_certificate_and_validates() -> None:
    docs = render_defaults("--set", "tls.enabled=true", "--set", "tls.secretName=df-controller-tls")
    for doc in docs:
        kubernetes_validate.validate(doc, "1.33.0", strict=True)
    (deploy,) = by_kind(docs, "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = container["args"]
    assert args[args.index("--tls-cert") + 1] == "/etc/deepfleet/tls/tls.crt"
    assert args[args.index("--tls-key") + 1] == "/etc/deepfleet/tls/tls.key"
    assert {"name": "tls", "secret": {"secretName": "df-controller-tls"}} in pod["volumes"]
    assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    proc = helm("template", "df", str(CHART), "--set", "tls.enabled=true")
    assert proc.returncode != 0 and "tls.secretName: tls.enabled needs" in proc.stderr


def test_the_api_network_policy_admits_the_workers_and_the_listed_peers() -> None:
    from tests.controller.test_k8s_network_policy import selects

    docs = render_defaults("--set", "networkPolicy.enabled=true", "--set", "jobNamespace=training",
                           "--set-json", 'networkPolicy.apiFrom=[{"namespaceSelector": {"matchLabels": '
                                         '{"kubernetes.io/metadata.name": "ingress-nginx"}}}]')
    for doc in docs:
        kubernetes_validate.validate(doc, "1.33.0", strict=True)
    (policy,) = by_kind(docs, "NetworkPolicy")
    (deploy,) = by_kind(docs, "Deployment")
    assert selects(policy["spec"]["podSelector"], deploy["spec"]["template"]["metadata"]["labels"])
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": 8080, "protocol": "TCP"}]

    def allowed(namespace: str, labels: dict[str, str]) -> bool:
        ns_labels = {"kubernetes.io/metadata.name": namespace}
        return any(selects(peer.get("namespaceSelector", {}), ns_labels) if "namespaceSelector" in peer
                   and selects(peer.get("podSelector", {}), labels) else False for peer in rule["from"])

    worker = {"app.kubernetes.io/name": "deepfleet-worker"}
    assert allowed("training", worker)
    assert not allowed("other", worker) and not allowed("training", {"app": "x"})
    assert allowed("ingress-nginx", {"app": "controller"})
    assert not by_kind(render_defaults(), "NetworkPolicy")


def test_api_processes_and_old_secrets_reach_the_controller() -> None:
    from deepfleet.controller.settings import Settings

    docs = render(DEFAULT, extra=("--set", "config.apiProcesses=3", "--set", "config.oldSecrets.secretName=rot"))
    (cm,) = by_kind(docs, "ConfigMap")
    assert Settings.from_env(cm["data"]).api_processes == 3
    (deploy,) = by_kind(docs, "Deployment")
    (ctr,) = deploy["spec"]["template"]["spec"]["containers"]
    old = next(e for e in ctr["env"] if e["name"] == "DEEPFLEET_OLD_SECRETS")
    assert old["valueFrom"]["secretKeyRef"] == {"name": "rot", "key": "old-secrets"}
    (plain,) = by_kind(render(DEFAULT), "Deployment")
    assert "DEEPFLEET_OLD_SECRETS" not in {e["name"] for e in plain["spec"]["template"]["spec"]["containers"][0]["env"]}
    for doc in docs:
        kubernetes_validate.validate(doc, "1.33.0", strict=True)


AZUREML = ("--set", "azureml.enabled=true", "--set", "azureml.subscriptionId=0b1f6471-1bf0-4dda-aec3-cb9272f09590",
           "--set", "azureml.resourceGroup=ml-rg", "--set", "azureml.workspace=ml-ws",
           "--set", "azureml.keyVault=https://ml-kv.vault.azure.net")


def test_azureml_settings_reach_the_controller_and_its_backend() -> None:
    from deepfleet.controller.settings import Settings

    with warnings.catch_warnings():  # the Azure ML SDK warns about its own classes as it imports them
        warnings.simplefilter("ignore")
        from deepfleet.controller.backends.azureml import KEY_VAULT_ENV, WORKSPACE_ENV

    docs = render(DEFAULT, extra=(*AZUREML, "--set", "azureml.workloadIdentity=true",
                                  "--set", "azureml.credentialsSecret=ml-sp"))
    (cm,) = by_kind(docs, "ConfigMap")
    assert Settings.from_env(cm["data"]).backends == ["kubernetes", "azureml"]
    assert [cm["data"][k] for k in WORKSPACE_ENV] == ["0b1f6471-1bf0-4dda-aec3-cb9272f09590", "ml-rg", "ml-ws"]
    assert cm["data"][KEY_VAULT_ENV] == "https://ml-kv.vault.azure.net"
    (deploy,) = by_kind(docs, "Deployment")
    pod = deploy["spec"]["template"]
    assert pod["metadata"]["labels"]["azure.workload.identity/use"] == "true"
    assert {"secretRef": {"name": "ml-sp"}} in pod["spec"]["containers"][0]["envFrom"]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.33.0", strict=True)
    # off by default: Kubernetes alone, no Azure names, no identity label, no credentials Secret
    (plain_cm,) = by_kind(render(DEFAULT), "ConfigMap")
    assert plain_cm["data"]["DEEPFLEET_BACKENDS"] == "kubernetes"
    assert not {*WORKSPACE_ENV, KEY_VAULT_ENV} & set(plain_cm["data"])


@pytest.mark.parametrize(("unset", "value"), [("azureml.workspace", ""), ("azureml.resourceGroup", "")])
def test_azureml_without_its_workspace_fails_naming_the_value(unset: str, value: str) -> None:
    proc = helm("template", "df", str(CHART), "--namespace", "ml", *AZUREML, "--set", f"{unset}={value}")
    assert proc.returncode != 0
    assert f"{unset}: azureml.enabled needs the workspace" in proc.stderr


def test_a_malformed_key_vault_url_is_refused_by_the_schema() -> None:
    proc = helm("template", "df", str(CHART), "--namespace", "ml", *AZUREML, "--set", "azureml.keyVault=ml-kv")
    assert proc.returncode != 0 and "keyVault" in proc.stderr
