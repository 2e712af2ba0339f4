"""`deepfleet run`: launch an unmodified DeepSpeed (or plain torchrun) training script on deepfleet.

    deepfleet run [LAUNCHER OPTIONS] script.py [SCRIPT ARGS...]

Accepts torchrun's options (`--nproc_per_node`, `--nnodes`, `--node_rank`, `--master_addr`,
`--master_port`, `--rdzv_backend`, `--rdzv_endpoint`, `--rdzv_id`, `--max_restarts`, `--standalone`,
dashes or underscores) and the common ones of DeepSpeed's launcher (`--num_gpus`/`--num_accelerators`,
`--num_nodes`, `--include`/`--exclude` for localhost slots, `--master_port`, `--master_addr`,
`--no_local_rank`). It starts the ranks with torch's elastic agent (`torch.distributed.run`, replacing
this process), each through `deepfleet.engine.compat.script_entry`, so inside them `import deepspeed`
is deepfleet's engine and the script's `--deepspeed_config` is read by `deepspeed.initialize(args=...)`.
On a machine without GPUs, `--num_gpus N` means N processes on the CPU (gloo). Without a size it
starts one process per GPU, or one on the CPU. Called by the `deepfleet` CLI as its own process (the
CLI stays torch-free). DeepSpeed's multi-node ssh launch (`--hostfile`) is refused: use
`--nnodes`/`--node_rank` on each node, or a deepfleet job.
"""

from __future__ import annotations

import argparse
import os
import sys

from deepfleet.engine.compat.script_entry import LOCAL_RANK_ARG_ENV

EXIT_USAGE = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepfleet run", allow_abbrev=False,
                                description="Run a DeepSpeed or torchrun training script on deepfleet.")

    def opt(*names: str, **kw) -> None:
        both = []
        for n in names:
            both += [n] if "_" not in n else [n, n.replace("_", "-")]
        p.add_argument(*dict.fromkeys(both), **kw)

    opt("--nproc_per_node", dest="nproc", default=None, help="processes on this node (torchrun)")
    opt("--num_gpus", "--num_accelerators", dest="num_gpus", type=int, default=None,
        help="processes on this node (DeepSpeed's launcher; on a CPU machine, CPU processes)")
    opt("--include", default=None, help='DeepSpeed\'s slot filter for this machine, e.g. "localhost:0,1"')
    opt("--exclude", default=None, help='slots to leave out, e.g. "localhost:1"')
    opt("--nnodes", "--num_nodes", dest="nnodes", default="1", help="number of nodes (or MIN:MAX)")
    opt("--node_rank", dest="node_rank", type=int, default=None)
    opt("--master_addr", dest="master_addr", default=None)
    opt("--master_port", dest="master_port", type=int, default=None)
    opt("--rdzv_backend", dest="rdzv_backend", default=None)
    opt("--rdzv_endpoint", dest="rdzv_endpoint", default=None)
    opt("--rdzv_id", dest="rdzv_id", default=None)
    opt("--max_restarts", dest="max_restarts", type=int, default=None)
    opt("--standalone", action="store_true")
    opt("--no_local_rank", action="store_true", help="do not append --local_rank=<n> to the script's arguments")
    opt("--hostfile", "--hostfile_path", dest="hostfile", default=None)
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def _slots(spec: str, option: str) -> list[int]:
    """`localhost:0,1` (or `0,1`) -> [0, 1]; other hosts are refused (this launcher is per node)."""
    out: list[int] = []
    for part in spec.split("@"):
        host, _, slots = part.rpartition(":") if ":" in part else ("localhost", "", part)
        if host not in ("localhost", "127.0.0.1", ""):
            raise ValueError(f"{option}: host {host!r}: only this machine's slots can be chosen; "
                             "run `deepfleet run` on each node with --nnodes/--node_rank")
        try:
            out += [int(s) for s in slots.split(",") if s]
        except ValueError:
            raise ValueError(f"{option}: {spec!r} is not HOST:SLOT,SLOT; e.g. localhost:0,1") from None
    return out


def _nproc(ns: argparse.Namespace) -> tuple[str, list[int] | None]:
    """Processes per node, and the device slots to use (CUDA_VISIBLE_DEVICES) when chosen."""
    if ns.include and ns.exclude:
        raise ValueError("--include and --exclude: use only one of them")
    import torch

    devices = torch.cuda.device_count()
    if ns.include:
        slots = _slots(ns.include, "--include")
        return str(len(slots)), slots if devices else None
    if ns.nproc is not None:
        return str(ns.nproc), None
    if ns.num_gpus is not None:
        if ns.num_gpus < 1:
            raise ValueError(f"--num_gpus: must be >= 1, got {ns.num_gpus}")
        return str(ns.num_gpus), None
    total = devices or 1
    if ns.exclude:
        gone = set(_slots(ns.exclude, "--exclude"))
        slots = [s for s in range(total) if s not in gone]
        if not slots:
            raise ValueError("--exclude: leaves no slot; keep at least one")
        return str(len(slots)), slots if devices else None
    return str(total), None


def torchrun_argv(ns: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The `torch.distributed.run` command line and the extra environment for `ns`."""
    if ns.hostfile:
        raise ValueError("--hostfile: DeepSpeed's ssh multi-node launch is not supported; run `deepfleet run "
                         "--nnodes N --node_rank R --master_addr HOST` on each node, or submit a deepfleet job")
    nproc, slots = _nproc(ns)
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--nnodes={ns.nnodes}"]
    single = str(ns.nnodes) == "1"
    if ns.standalone or (single and ns.master_port is None and ns.rdzv_endpoint is None):
        argv.append("--standalone")  # c10d rendezvous on a port the agent binds itself
    for flag, value in (("--node_rank", ns.node_rank), ("--master_addr", ns.master_addr),
                        ("--master_port", ns.master_port), ("--rdzv_backend", ns.rdzv_backend),
                        ("--rdzv_endpoint", ns.rdzv_endpoint), ("--rdzv_id", ns.rdzv_id),
                        ("--max_restarts", ns.max_restarts)):
        if value is not None:
            argv.append(f"{flag}={value}")
    argv += ["-m", "deepfleet.engine.compat.script_entry", ns.script, *ns.script_args]
    env = {LOCAL_RANK_ARG_ENV: "0" if ns.no_local_rank else "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    if slots is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(s) for s in slots)
    return argv, env


def main(argv: list[str] | None = None) -> None:
    ns = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        command, env = torchrun_argv(ns)
    except ValueError as e:
        print(f"deepfleet run: {e}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
    if not os.path.isfile(ns.script):
        print(f"deepfleet run: {ns.script}: no such script", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)
    os.environ.update(env)
    sys.stdout.flush()
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
