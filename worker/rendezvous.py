"""Normalize each backend's environment into one rendezvous contract.

Caller: `worker/agent.py` (builds torchrun's LaunchConfig from `Rendezvous`). Each platform names the
node's index and the first node's address differently; this module reads them and returns the same
`Rendezvous` for the same job on every platform, so nothing downstream branches on the platform.
Hand-written because torchrun only reads its own flags and the Azure ML / Kubernetes SDKs only cover
job submission, not the in-container view.

Variables read, per platform (the backends set them; the names are part of the backend contract):

local (`deepfleet.controller.backends.local`, or a person running the worker by hand)
    DEEPFLEET_NODE_RANK (default 0), DEEPFLEET_NNODES (default nodes.max),
    DEEPFLEET_MASTER_ADDR (default 127.0.0.1), DEEPFLEET_MASTER_PORT (default rendezvous.port).
kubernetes (an Indexed Job whose pods set `subdomain` to a headless Service)
    JOB_COMPLETION_INDEX (set by Kubernetes) -> node rank;
    DEEPFLEET_K8S_JOB (the Job's name), DEEPFLEET_RDZV_SERVICE (the headless Service's name),
    DEEPFLEET_NAMESPACE (downward API `metadata.namespace`), DEEPFLEET_NNODES (the Job's completions);
    the first node is `<job>-0.<service>.<namespace>.svc` (the stable DNS name of index 0),
    DEEPFLEET_MASTER_PORT (default rendezvous.port).
azureml (command job, `distribution: PyTorch` with process_count_per_instance=1, or MPI)
    NODE_RANK, MASTER_ADDR, MASTER_PORT (PyTorch distribution); the node count from
    AZUREML_NODE_COUNT, else WORLD_SIZE (one process per instance), else OMPI_COMM_WORLD_SIZE /
    OMPI_COMM_WORLD_LOCAL_SIZE. Under MPI: OMPI_COMM_WORLD_RANK // OMPI_COMM_WORLD_LOCAL_SIZE as the
    node rank and AZ_BATCH_MASTER_NODE ("host:port") or AZ_BATCHAI_MPI_MASTER_NODE as the first node.

On every platform DEEPFLEET_NNODES, when set, overrides the platform's node count, and the spec's
`rendezvous.endpoint` overrides the derived rendezvous endpoint.

Port 0 (DEEPFLEET_MASTER_PORT=0 or `rendezvous.port: 0`, what the local backend asks for): node 0 binds
the rendezvous store on a port the kernel picks and publishes it, and the other nodes read it, so no
port is ever picked first and bound later (another program could take it in between). `bind_store`
does this: node 0 starts a multi-tenant TCPStore server on port 0 and keeps it, torch's c10d rendezvous
handler then opens the same server (it reuses a multi-tenant server of this process on that port), and
the port goes to DEEPFLEET_RDZV_PORT_FILE (written to a temporary name, then renamed), which the other
nodes, on the same host, wait for. Without the file only a single-node job may use port 0.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from deepfleet.worker.spec import PORT_FILE_ENV, WorkerSpec

PLATFORMS = ("local", "kubernetes", "azureml")


class RendezvousEnvError(ValueError):
    """The platform's environment lacks or garbles a variable the contract needs (one line, names it)."""


@dataclass(frozen=True)
class Rendezvous:
    """One node's view of the job's process layout, the same on every platform."""

    platform: str
    node_rank: int  # this node's index among the nodes the platform started (0 hosts the store)
    nnodes: int  # nodes the platform started
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    master_addr: str  # the first node's address
    master_port: int
    endpoint: str  # "host:port" of the c10d rendezvous store
    run_id: str
    port_file: str | None = None  # where node 0 publishes the port it bound (port 0 only)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def process_env(self, local_rank: int) -> dict[str, str]:
        """The torch.distributed env:// variables of one training process in a static (non-elastic)
        layout: node-major global ranks. torchrun assigns the same when every node joins the first
        rendezvous round in node-rank order; elastic rounds may renumber nodes."""
        if not 0 <= local_rank < self.nproc_per_node:
            raise ValueError(f"local_rank={local_rank} is outside [0, {self.nproc_per_node})")
        return {
            "WORLD_SIZE": str(self.world_size),
            "RANK": str(self.node_rank * self.nproc_per_node + local_rank),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(self.nproc_per_node),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def detect_platform(environ: Mapping[str, str]) -> str:
    """Which platform started this process, from the variables only that platform's runtime sets.

    Not "any AZUREML_* variable": the azure-ai-ml SDK itself exports AZUREML_CURRENT_CLOUD into the
    process that uses it (a controller), and a local worker inherits it."""
    if any(k in environ for k in ("AZUREML_RUN_ID", "AZ_BATCH_MASTER_NODE", "AZ_BATCHAI_MPI_MASTER_NODE")):
        return "azureml"
    if "JOB_COMPLETION_INDEX" in environ:
        return "kubernetes"
    return "local"


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise RendezvousEnvError(f"{name}: not set; the backend must set it for this platform")
        return default
    try:
        return int(raw)
    except ValueError:
        raise RendezvousEnvError(f"{name}: {raw!r} is not an integer; set it to a whole number") from None


def _need(environ: Mapping[str, str], name: str) -> str:
    value = environ.get(name)
    if not value:
        raise RendezvousEnvError(f"{name}: not set; the backend must set it for this platform")
    return value


def _local(spec: WorkerSpec, env: Mapping[str, str]) -> tuple[int, int, str, int]:
    return (
        _int(env, "DEEPFLEET_NODE_RANK", 0),
        _int(env, "DEEPFLEET_NNODES", spec.nodes.max),
        env.get("DEEPFLEET_MASTER_ADDR") or "127.0.0.1",
        _int(env, "DEEPFLEET_MASTER_PORT", spec.rendezvous.port),
    )


def _kubernetes(spec: WorkerSpec, env: Mapping[str, str]) -> tuple[int, int, str, int]:
    job, service, namespace = (_need(env, n) for n in ("DEEPFLEET_K8S_JOB", "DEEPFLEET_RDZV_SERVICE",
                                                       "DEEPFLEET_NAMESPACE"))
    return (
        _int(env, "JOB_COMPLETION_INDEX"),
        _int(env, "DEEPFLEET_NNODES", spec.nodes.max),
        f"{job}-0.{service}.{namespace}.svc",
        _int(env, "DEEPFLEET_MASTER_PORT", spec.rendezvous.port),
    )


def _azureml(spec: WorkerSpec, env: Mapping[str, str]) -> tuple[int, int, str, int]:
    mpi_local = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1)
    if "NODE_RANK" in env:
        node_rank = _int(env, "NODE_RANK")
    elif "OMPI_COMM_WORLD_RANK" in env:
        node_rank = _int(env, "OMPI_COMM_WORLD_RANK") // mpi_local
    else:
        raise RendezvousEnvError("NODE_RANK: not set (nor OMPI_COMM_WORLD_RANK); submit the Azure ML job "
                                 "with distribution PyTorch or MPI")
    if "AZUREML_NODE_COUNT" in env:
        nnodes = _int(env, "AZUREML_NODE_COUNT")
    elif "OMPI_COMM_WORLD_SIZE" in env:
        nnodes = _int(env, "OMPI_COMM_WORLD_SIZE") // mpi_local
    else:
        nnodes = _int(env, "WORLD_SIZE", spec.nodes.max)
    if env.get("MASTER_ADDR"):
        addr, port = env["MASTER_ADDR"], _int(env, "MASTER_PORT", spec.rendezvous.port)
    elif env.get("AZ_BATCH_MASTER_NODE"):
        value = env["AZ_BATCH_MASTER_NODE"]
        host, sep, p = value.rpartition(":")
        addr, port = (host, int(p)) if sep and p.isdigit() else (value, spec.rendezvous.port)
    else:
        addr, port = _need(env, "AZ_BATCHAI_MPI_MASTER_NODE"), spec.rendezvous.port
    return node_rank, nnodes, addr, port


_READERS = {"local": _local, "kubernetes": _kubernetes, "azureml": _azureml}


def resolve(spec: WorkerSpec, environ: Mapping[str, str]) -> Rendezvous:
    """This node's Rendezvous for `spec` from the platform's environment.

    Raises RendezvousEnvError (one line naming the variable) when the environment is incomplete or
    inconsistent with the spec's node range."""
    platform = detect_platform(environ) if spec.platform == "auto" else spec.platform
    node_rank, nnodes, addr, port = _READERS[platform](spec, environ)
    if "DEEPFLEET_NNODES" in environ:
        nnodes = _int(environ, "DEEPFLEET_NNODES")
    if not spec.nodes.min <= nnodes <= spec.nodes.max:
        raise RendezvousEnvError(f"nodes: the platform started {nnodes} node(s), outside the spec's range "
                                 f"[{spec.nodes.min}, {spec.nodes.max}]; widen nodes.min/nodes.max")
    if not 0 <= node_rank < nnodes:
        raise RendezvousEnvError(f"node_rank: {node_rank} is outside [0, {nnodes}); check the platform's "
                                 "node-rank variable")
    if not 0 <= port < 65536:
        raise RendezvousEnvError(f"master_port: {port} is not a TCP port; set a port in 1..65535 (or 0: node 0 picks)")
    port_file = environ.get(PORT_FILE_ENV) or None
    if port == 0 and not spec.rendezvous.endpoint and port_file is None and spec.nodes.max > 1:
        raise RendezvousEnvError(f"master_port: 0 (node 0 picks the port) with up to {spec.nodes.max} nodes needs "
                                 f"{PORT_FILE_ENV}, a file on a shared path where node 0 publishes it; set it "
                                 "or give a fixed port")
    return Rendezvous(
        platform=platform,
        node_rank=node_rank,
        nnodes=nnodes,
        min_nodes=spec.nodes.min,
        max_nodes=spec.nodes.max,
        nproc_per_node=spec.processes_per_node,
        master_addr=addr,
        master_port=port,
        endpoint=spec.rendezvous.endpoint or f"{addr}:{port}",
        run_id=spec.run_id,
        port_file=port_file,
    )


def bind_store(rdzv: Rendezvous, *, timeout_s: float) -> tuple[Rendezvous, Any]:
    """(`rdzv` on its real port, the store server node 0 keeps open or None) for a port-0 rendezvous;
    `rdzv` itself and None otherwise (a fixed port, or a `rendezvous.endpoint` the spec names, which is
    never on port 0). Node 0 binds and publishes, the other nodes wait up to `timeout_s` for the
    published port (RendezvousEnvError when it does not come)."""
    if not rdzv.endpoint.endswith(":0"):
        return rdzv, None
    server = None
    if rdzv.node_rank == 0:
        import datetime

        from torch.distributed import TCPStore

        server = TCPStore(rdzv.master_addr, 0, is_master=True, multi_tenant=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=max(1.0, timeout_s)))
        port = server.port
        if rdzv.port_file is not None:
            target = Path(rdzv.port_file)
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            tmp.write_text(f"{port}\n")
            os.replace(tmp, target)
    else:
        port = _wait_for_port(rdzv.port_file, timeout_s)
    return replace(rdzv, master_port=port, endpoint=f"{rdzv.master_addr}:{port}"), server


def _wait_for_port(port_file: str | None, timeout_s: float) -> int:
    if port_file is None:
        raise RendezvousEnvError(f"master_port: 0 on a node other than node 0 needs {PORT_FILE_ENV}; set it")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            text = Path(port_file).read_text().strip()
        except FileNotFoundError:
            text = ""
        if text.isdigit() and 0 < int(text) < 65536:
            return int(text)
        if time.monotonic() > deadline:
            raise RendezvousEnvError(f"{PORT_FILE_ENV}: node 0 did not publish its rendezvous port in {port_file} "
                                     f"within {timeout_s:.0f} s; check that node 0 started (its log)")
        time.sleep(0.05)
