"""A run's NetworkPolicy: valid against the upstream schemas, and (evaluated over pod label sets)
admitting exactly the same run's pods to every port of its pods."""

from __future__ import annotations

import kubernetes_validate
import pytest

from deepfleet.controller.backends.kubernetes import manifests, names
from tests.controller.example_jobs import example_submission

JOB_UID = "5b7d7c52-0000-4000-8000-000000000001"


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """Kubernetes' LabelSelector semantics (matchLabels and matchExpressions; {} selects everything)."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if (op == "In" and labels.get(key) not in values) or (op == "NotIn" and labels.get(key) in values) \
                or (op == "Exists" and key not in labels) or (op == "DoesNotExist" and key in labels):
            return False
    return True


def admits(policy: dict, *, target: dict[str, str], source: dict[str, str], same_namespace: bool = True) -> bool:
    """Whether `policy` lets a pod labelled `source` reach a pod labelled `target` (ingress only)."""
    spec = policy["spec"]
    if not selects(spec["podSelector"], target):
        return True  # not governed by this policy
    for rule in spec.get("ingress") or []:
        for peer in rule.get("from") or []:
            if "namespaceSelector" not in peer and not same_namespace:
                continue
            if "podSelector" in peer and selects(peer["podSelector"], source):
                return True
    return False


@pytest.fixture(scope="module")
def policy() -> tuple[dict, dict]:
    sub = example_submission("kubernetes")
    return manifests.network_policy(sub, namespace="default", job_uid=JOB_UID), manifests.labels(sub)


@pytest.mark.parametrize("version", ["1.30.0", "1.33.0"])
def test_the_policy_passes_the_upstream_schema(policy, version: str) -> None:
    kubernetes_validate.validate(policy[0], version, strict=True)


def _other_run(labels: dict[str, str]) -> dict[str, str]:
    return {**labels, names.RUN: labels[names.RUN] + "x", names.ATTEMPT: "9"}


CASES = [
    ("a pod of the same run", lambda lab: dict(lab), True),
    ("the same run, labels trimmed to the run label", lambda lab: {names.RUN: lab[names.RUN]}, True),
    ("another attempt of the same job", lambda lab: {**lab, names.RUN: lab[names.RUN][:-1] + "9"}, False),
    ("another job's pod", _other_run, False),
    ("a pod with deepfleet's other labels but no run label", lambda lab: {k: v for k, v in lab.items()
                                                                           if k != names.RUN}, False),
    ("an unlabelled pod", lambda lab: {}, False),
]


@pytest.mark.parametrize(("what", "source", "allowed"), CASES, ids=[c[0] for c in CASES])
def test_only_the_runs_own_pods_are_admitted(policy, what: str, source, allowed: bool) -> None:
    pol, lab = policy
    assert admits(pol, target=lab, source=source(lab)) is allowed, what
    assert not admits(pol, target=lab, source=source(lab), same_namespace=False)  # never from elsewhere


def test_the_policy_governs_the_runs_pods_only_and_every_port(policy) -> None:
    pol, lab = policy
    assert selects(pol["spec"]["podSelector"], lab)
    assert not selects(pol["spec"]["podSelector"], _other_run(lab))
    assert all("ports" not in rule for rule in pol["spec"]["ingress"])  # rendezvous + ephemeral collective ports
    assert pol["spec"]["policyTypes"] == ["Ingress"]  # egress (heartbeats, data) untouched
    assert pol["metadata"]["ownerReferences"][0]["uid"] == JOB_UID

