"""worker/rendezvous.py: each platform's environment, read per backend, and a conformance table: the
same job on local, Kubernetes and Azure ML gives every process the same WORLD_SIZE, RANK, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT."""

from __future__ import annotations

import datetime
import threading
from pathlib import Path

import pytest

from deepfleet.worker.rendezvous import RendezvousEnvError, bind_store, detect_platform, resolve
from deepfleet.worker.spec import parse_worker_spec


def _spec(**over: object):
    data = {"job_id": "jx", "attempt": 1, "entrypoint": {"script": "t.py"}, "nodes": {"min": 1, "max": 3},
            "processes_per_node": 2, "rendezvous": {"port": 29500}}
    data.update(over)
    return parse_worker_spec(data, environ={})


def test_local_defaults_are_a_single_node_on_loopback() -> None:
    r = resolve(_spec(nodes={"min": 1, "max": 1}), {})
    assert (r.platform, r.node_rank, r.nnodes, r.master_addr, r.master_port) == ("local", 0, 1, "127.0.0.1", 29500)
    assert (r.endpoint, r.run_id, r.world_size) == ("127.0.0.1:29500", "jx-1", 2)


def test_kubernetes_indexed_job_uses_index_and_headless_service_dns() -> None:
    env = {"JOB_COMPLETION_INDEX": "2", "DEEPFLEET_K8S_JOB": "df-jx-1", "DEEPFLEET_RDZV_SERVICE": "df-jx-1",
           "DEEPFLEET_NAMESPACE": "team-a", "DEEPFLEET_NNODES": "3"}
    r = resolve(_spec(), env)
    assert r.platform == "kubernetes" and r.node_rank == 2 and r.nnodes == 3
    assert r.master_addr == "df-jx-1-0.df-jx-1.team-a.svc" and r.endpoint == "df-jx-1-0.df-jx-1.team-a.svc:29500"


def test_azureml_pytorch_distribution_and_mpi() -> None:
    pt = {"AZUREML_RUN_ID": "r", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.4", "MASTER_PORT": "6105",
          "AZUREML_NODE_COUNT": "2"}
    r = resolve(_spec(), pt)
    assert (r.platform, r.node_rank, r.nnodes, r.master_addr, r.master_port) == ("azureml", 1, 2, "10.0.0.4", 6105)
    mpi = {"AZUREML_RUN_ID": "r", "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "AZ_BATCH_MASTER_NODE": "10.0.0.9:6000"}
    r = resolve(_spec(), mpi)
    assert (r.node_rank, r.nnodes, r.master_addr, r.master_port) == (2, 3, "10.0.0.9", 6000)
    mpi2 = {"AZUREML_RUN_ID": "r", "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1",
            "AZ_BATCHAI_MPI_MASTER_NODE": "10.0.0.7"}
    assert resolve(_spec(), mpi2).endpoint == "10.0.0.7:29500"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"JOB_COMPLETION_INDEX": "0", "DEEPFLEET_K8S_JOB": "j", "DEEPFLEET_NAMESPACE": "n"},
         "DEEPFLEET_RDZV_SERVICE: not set"),
        ({"JOB_COMPLETION_INDEX": "x", "DEEPFLEET_K8S_JOB": "j", "DEEPFLEET_RDZV_SERVICE": "s",
          "DEEPFLEET_NAMESPACE": "n"}, "JOB_COMPLETION_INDEX: 'x' is not an integer"),
        ({"AZUREML_RUN_ID": "r", "MASTER_ADDR": "h"}, "NODE_RANK: not set"),
        ({"DEEPFLEET_NNODES": "5"}, "nodes: the platform started 5 node(s), outside the spec's range [1, 3]"),
        ({"DEEPFLEET_NODE_RANK": "3", "DEEPFLEET_NNODES": "2"}, "node_rank: 3 is outside [0, 2)"),
    ],
)
def test_incomplete_environments_name_the_variable(env: dict, message: str) -> None:
    with pytest.raises(RendezvousEnvError) as e:
        resolve(_spec(), env)
    assert str(e.value).startswith(message)


def test_port_zero_node_zero_binds_and_publishes_the_other_nodes_read_it(tmp_path: Path) -> None:
    """No port is picked and bound later: node 0 binds port 0 and keeps the server; node 1 waits for
    the port file, and a store client on the published endpoint reaches node 0's server."""
    from torch.distributed import TCPStore

    port_file = tmp_path / "run.rdzv-port"
    env = {"DEEPFLEET_NNODES": "2", "DEEPFLEET_MASTER_PORT": "0", "DEEPFLEET_RDZV_PORT_FILE": str(port_file)}
    spec = _spec()
    nodes = [resolve(spec, {**env, "DEEPFLEET_NODE_RANK": str(n)}) for n in (0, 1)]
    assert [(n.master_port, n.port_file) for n in nodes] == [(0, str(port_file))] * 2
    got: list = []
    reader = threading.Thread(target=lambda: got.append(bind_store(nodes[1], timeout_s=20)))
    reader.start()  # node 1 first: it waits until node 0 publishes
    bound, server = bind_store(nodes[0], timeout_s=20)
    reader.join(30)
    (late, no_server), = got
    assert server is not None and no_server is None and 0 < bound.master_port < 65536
    assert late.master_port == bound.master_port and late.endpoint == bound.endpoint == f"127.0.0.1:{server.port}"
    assert port_file.read_text().strip() == str(server.port) and not list(tmp_path.glob(".*.tmp"))
    # torch's c10d handler opens the store as a multi-tenant master on that port: it reuses node 0's server
    host = TCPStore("127.0.0.1", bound.master_port, is_master=True, multi_tenant=True,
                    timeout=datetime.timedelta(seconds=10))
    host.set("joined", "1")
    client = TCPStore("127.0.0.1", late.master_port, is_master=False, timeout=datetime.timedelta(seconds=10))
    assert client.get("joined") == b"1" and server.get("joined") == b"1"
    # a fixed port is left as it is, with no server
    fixed = resolve(spec, {"DEEPFLEET_NNODES": "2", "DEEPFLEET_MASTER_PORT": "29500"})
    assert bind_store(fixed, timeout_s=1) == (fixed, None)
    # so is an endpoint the spec names, whatever the port variable says
    named = resolve(_spec(rendezvous={"endpoint": "10.0.0.4:29511", "port": 0}), {"DEEPFLEET_NNODES": "2"})
    assert bind_store(named, timeout_s=1) == (named, None) and named.endpoint == "10.0.0.4:29511"


def test_port_zero_errors_name_the_variable(tmp_path: Path) -> None:
    with pytest.raises(RendezvousEnvError, match="^master_port: 0 .* needs DEEPFLEET_RDZV_PORT_FILE"):
        resolve(_spec(), {"DEEPFLEET_NNODES": "2", "DEEPFLEET_MASTER_PORT": "0"})
    single = resolve(_spec(nodes={"min": 1, "max": 1}, rendezvous={"port": 0}), {})
    bound, server = bind_store(single, timeout_s=5)  # one node: no file needed
    assert server is not None and bound.master_port == server.port > 0
    waiting = resolve(_spec(), {"DEEPFLEET_NNODES": "2", "DEEPFLEET_NODE_RANK": "1", "DEEPFLEET_MASTER_PORT": "0",
                                "DEEPFLEET_RDZV_PORT_FILE": str(tmp_path / "never")})
    with pytest.raises(RendezvousEnvError, match="^DEEPFLEET_RDZV_PORT_FILE: node 0 did not publish"):
        bind_store(waiting, timeout_s=0.3)


@pytest.mark.parametrize(
    ("env", "platform"),
    [
        ({}, "local"),
        ({"AZUREML_CURRENT_CLOUD": "AzureCloud"}, "local"),  # exported by the azure-ai-ml SDK anywhere it runs
        ({"AZUREML_RUN_ID": "r"}, "azureml"),
        ({"AZ_BATCH_MASTER_NODE": "10.0.0.1:6000"}, "azureml"),
        ({"JOB_COMPLETION_INDEX": "0"}, "kubernetes"),
    ],
)
def test_detect_platform(env: dict, platform: str) -> None:
    assert detect_platform(env) == platform


def test_spec_endpoint_and_platform_override_detection() -> None:
    env = {"AZUREML_RUN_ID": "r", "DEEPFLEET_NODE_RANK": "1", "DEEPFLEET_NNODES": "2"}
    assert detect_platform(env) == "azureml"
    r = resolve(_spec(platform="local", rendezvous={"endpoint": "store:1234"}), env)
    assert (r.platform, r.node_rank, r.endpoint, r.master_addr) == ("local", 1, "store:1234", "127.0.0.1")


# The same two-node job as each platform would start node `n`; the first node answers at HOST:PORT.
HOST, PORT = "node0.example", 29511


def _platform_env(platform: str, node: int) -> dict[str, str]:
    if platform == "local":
        return {"DEEPFLEET_NODE_RANK": str(node), "DEEPFLEET_NNODES": "2", "DEEPFLEET_MASTER_ADDR": HOST,
                "DEEPFLEET_MASTER_PORT": str(PORT)}
    if platform == "kubernetes":
        return {"JOB_COMPLETION_INDEX": str(node), "DEEPFLEET_K8S_JOB": "node0", "DEEPFLEET_RDZV_SERVICE": "example",
                "DEEPFLEET_NAMESPACE": "ns", "DEEPFLEET_NNODES": "2", "DEEPFLEET_MASTER_PORT": str(PORT)}
    return {"AZUREML_RUN_ID": "run", "AZUREML_NODE_COUNT": "2", "NODE_RANK": str(node), "MASTER_ADDR": HOST,
            "MASTER_PORT": str(PORT), "WORLD_SIZE": "2", "RANK": str(node), "LOCAL_RANK": "0"}


def _layout(platform: str) -> list[dict[str, str]]:
    spec = _spec(nodes={"min": 2, "max": 2})
    out = []
    for node in range(2):
        r = resolve(spec, _platform_env(platform, node))
        assert r.platform == platform
        for local_rank in range(spec.processes_per_node):
            env = r.process_env(local_rank)
            # Kubernetes names the first node by its DNS name; compare it as the address it resolves to.
            env["MASTER_ADDR"] = HOST if env["MASTER_ADDR"] == "node0-0.example.ns.svc" else env["MASTER_ADDR"]
            out.append({k: env[k] for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")})
    return out


def test_conformance_same_job_same_process_env_on_every_platform() -> None:
    expected = [
        {"WORLD_SIZE": "4", "RANK": str(rank), "LOCAL_RANK": str(rank % 2), "MASTER_ADDR": HOST,
         "MASTER_PORT": str(PORT)}
        for rank in range(4)
    ]
    for platform in ("local", "kubernetes", "azureml"):
        assert _layout(platform) == expected, platform
