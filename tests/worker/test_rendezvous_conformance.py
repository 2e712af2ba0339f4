"""Rendezvous conformance: for the same job, the environment each backend gives its nodes normalizes
through `worker/rendezvous.py` to the same process layout (WORLD_SIZE, node-major RANK, LOCAL_RANK) with
node 0 as the master on the port that platform designates.

* local: the real LocalBackend starts each node as a process that records its environment;
* kubernetes: the env of the rendered Indexed-Job pods as the fake API server creates them (the manifest's
  values, the downward-API namespace, the token from the run's Secret, JOB_COMPLETION_INDEX), with node
  0's DNS name checked against the index-0 pod's hostname and subdomain;
* azureml: the environment variables of the submitted command job plus what Azure ML's PyTorch
  distribution documents for each instance (MASTER_ADDR, MASTER_PORT, NODE_RANK, WORLD_SIZE, RANK,
  LOCAL_RANK; one process per instance).
"""

from __future__ import annotations

import base64
import json
import sys
import time
import warnings
from pathlib import Path

import pytest

from deepfleet.controller.backends.base import RunPhase
from deepfleet.controller.backends.kubernetes.backend import KubernetesBackend, connect
from deepfleet.controller.backends.local import LocalBackend
from deepfleet.worker.rendezvous import Rendezvous, resolve
from deepfleet.worker.spec import SPEC_ENV, TOKEN_ENV, load_worker_spec
from tests.controller.example_jobs import example_submission
from tests.controller.fake_kube import FakeKubeAPI

NODES, PROCS = 2, 2
DUMP_ENV = "import json, os; json.dump(dict(os.environ), open(os.environ['DF_EXIT_FILE'] + '.env', 'w'))"


def _resolve(env: dict[str, str]) -> Rendezvous:
    return resolve(load_worker_spec(environ=env), env)


def local_nodes(tmp_path: Path) -> tuple[list[Rendezvous], dict]:
    sub = example_submission("local", processesPerNode=PROCS)
    backend = LocalBackend(tmp_path / "logs", workdir=tmp_path, worker_command=[sys.executable, "-c", DUMP_ENV])
    backend.submit(sub)
    deadline = time.monotonic() + 20
    while backend.observe(sub.name).phase is not RunPhase.SUCCEEDED:
        assert time.monotonic() < deadline, backend.observe(sub.name)
        time.sleep(0.05)
    state = json.loads((backend.run_dir(sub.name) / "state.json").read_text())
    status = Path(state["status_dir"])
    envs = [json.loads((status / f"{sub.name}.node-{i}.exit.env").read_text()) for i in range(NODES)]
    return [_resolve(e) for e in envs], state


def kubernetes_envs(tmp_path: Path) -> tuple[list[dict[str, str]], list[dict]]:
    """The environment each pod's container gets, resolved as the kubelet does, and the pods."""
    fake = FakeKubeAPI().start()
    backend = KubernetesBackend(connect(fake.kubeconfig(tmp_path / "kubeconfig")), namespace="default")
    try:
        sub = example_submission("kubernetes", processesPerNode=PROCS)
        backend.submit(sub)
        pods = sorted(fake.list("pods", "default"), key=lambda p: p["spec"]["hostname"])
        secrets = {s["metadata"]["name"]: s for s in fake.list("secrets", "default")}
    finally:
        backend.close()
        fake.stop()
    envs = []
    for pod in pods:
        env = {}
        for var in pod["spec"]["containers"][0]["env"]:
            if "value" in var:
                env[var["name"]] = var["value"]
            elif "secretKeyRef" in var["valueFrom"]:
                ref = var["valueFrom"]["secretKeyRef"]
                env[var["name"]] = base64.b64decode(secrets[ref["name"]]["data"][ref["key"]]).decode()
            else:  # the downward API, as the kubelet resolves it
                path = var["valueFrom"]["fieldRef"]["fieldPath"]
                env[var["name"]] = pod["metadata"][path.split(".", 1)[1]]
        envs.append(env)
    return envs, pods


def kubernetes_nodes(tmp_path: Path) -> tuple[list[Rendezvous], list[dict]]:
    envs, pods = kubernetes_envs(tmp_path)
    return [_resolve(env) for env in envs], pods


def azureml_nodes() -> list[Rendezvous]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from deepfleet.controller.backends.azureml import AzureMLBackend
        from deepfleet.controller.backends.azureml import connect as aml_connect
        from tests.controller.fake_azureml import SUBSCRIPTION, FakeAzureML, FakeCredential

        fake = FakeAzureML()
        sub = example_submission("azureml", processesPerNode=PROCS)
        AzureMLBackend(aml_connect(SUBSCRIPTION, "rg", "ws", credential=FakeCredential(), transport=fake)).submit(sub)
    props = fake.job_puts()[0].body["properties"]
    per_instance = props["distribution"]["processCountPerInstance"]
    instances = props["resources"]["instanceCount"]
    nodes = []
    for node in range(instances):
        azure = {"MASTER_ADDR": "10.0.0.4", "MASTER_PORT": "6105", "NODE_RANK": str(node),
                 "WORLD_SIZE": str(instances * per_instance), "RANK": str(node * per_instance), "LOCAL_RANK": "0",
                 "AZUREML_RUN_ID": sub.name}
        nodes.append(_resolve({**props["environmentVariables"], **azure}))
    return nodes


def layout(nodes: list[Rendezvous]) -> list[dict[str, str]]:
    """Every training process's torch.distributed variables except the platform's master address/port."""
    out = []
    for rdzv in nodes:
        for local_rank in range(rdzv.nproc_per_node):
            env = rdzv.process_env(local_rank)
            out.append({k: v for k, v in env.items() if k not in ("MASTER_ADDR", "MASTER_PORT")})
    return sorted(out, key=lambda e: int(e["RANK"]))


def test_every_backend_yields_the_same_process_layout(tmp_path: Path) -> None:
    local, state = local_nodes(tmp_path)
    k8s, pods = kubernetes_nodes(tmp_path)
    aml = azureml_nodes()
    expected = [{"WORLD_SIZE": "4", "RANK": str(r), "LOCAL_RANK": str(r % PROCS), "LOCAL_WORLD_SIZE": str(PROCS),
                 "GROUP_RANK": str(r // PROCS)} for r in range(NODES * PROCS)]
    for platform, nodes in (("local", local), ("kubernetes", k8s), ("azureml", aml)):
        assert [n.platform for n in nodes] == [platform] * NODES
        assert sorted(n.node_rank for n in nodes) == list(range(NODES))
        assert {(n.nnodes, n.nproc_per_node, n.min_nodes, n.max_nodes) for n in nodes} == {(NODES, PROCS, NODES, NODES)}
        assert layout(nodes) == expected, platform
        # One master for the whole job: every node names the same address, port and store endpoint.
        assert len({(n.master_addr, n.master_port, n.endpoint, n.run_id, n.port_file) for n in nodes}) == 1, platform
    # ...and it is node 0 on the port the platform designates: locally, the one node 0 binds (port 0)
    # and publishes in the run's port file.
    assert (local[0].master_addr, local[0].master_port, local[0].port_file) == ("127.0.0.1", 0, state["port_file"])
    index0 = next(p for p in pods if p["spec"]["hostname"].endswith("-0"))
    assert k8s[0].master_addr == f"{index0['spec']['hostname']}.{index0['spec']['subdomain']}.default.svc"
    assert k8s[0].master_port == 29400 and k8s[0].endpoint == f"{k8s[0].master_addr}:29400"
    assert (aml[0].master_addr, aml[0].master_port, aml[0].endpoint) == ("10.0.0.4", 6105, "10.0.0.4:6105")


@pytest.mark.parametrize("platform", ["kubernetes", "azureml"])
def test_the_cloud_backends_pass_the_spec_the_worker_reads(platform: str, tmp_path: Path) -> None:
    nodes = kubernetes_nodes(tmp_path)[0] if platform == "kubernetes" else azureml_nodes()
    sub = example_submission(platform, processesPerNode=PROCS)
    assert {n.run_id for n in nodes} == {sub.worker_spec.run_id}
    assert json.loads(sub.env[SPEC_ENV])["platform"] == platform


def test_kubernetes_pods_get_the_job_token_from_the_run_secret(tmp_path: Path) -> None:
    envs, _ = kubernetes_envs(tmp_path)
    sub = example_submission("kubernetes", processesPerNode=PROCS)
    assert [env[TOKEN_ENV] for env in envs] == [sub.env[TOKEN_ENV]] * NODES
