"""`deepfleet-worker`: the process every backend starts once per node.

Caller: the console script `deepfleet-worker` (pyproject), started by the local, Kubernetes and Azure ML
backends. Reads the WorkerSpec from `--spec` (JSON text or a .json/.yaml path) or from
`DEEPFLEET_WORKER_SPEC`, then hands it to `worker/agent.py`. The process's exit status is the worker
exit-code contract (DESIGN.md): an invalid spec prints one line per problem naming the field and exits
64 without a traceback. argparse (stdlib) rather than typer: usage errors must exit 64, not 2, and
this entry point must start without the CLI stack.
"""

from __future__ import annotations

import argparse
import os
import sys

from deepfleet.worker.spec import KEYVAULT_SECRETS_ENV, ExitCode, WorkerSpecError, load_worker_spec


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"deepfleet-worker: {message}; see deepfleet-worker --help", file=sys.stderr)
        raise SystemExit(int(ExitCode.INVALID_SPEC))


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="deepfleet-worker",
        description="Run one node of a deepfleet training job under torch's elastic agent.",
    )
    p.add_argument("--spec", help="WorkerSpec as JSON text or a .json/.yaml path (default: $DEEPFLEET_WORKER_SPEC)")
    p.add_argument("--check", action="store_true", help="validate the spec and the node environment, then exit")
    p.add_argument("--export-dir", help="where node 0 writes the exported model when the spec asks for one "
                   "(default <checkpoint.dir>/export; Azure ML passes the job's model output)")
    p.add_argument("--checkpoint-dir", help="checkpoint directory, instead of the spec's checkpoint.dir (Azure ML "
                   "passes the job's checkpoint output, or a serving job's checkpoint input)")
    p.add_argument("--resume-dir", help="read-only directory holding the checkpoint checkpoint.resumeFrom names "
                   "(Azure ML passes the source job's checkpoint input); copied into the checkpoint dir when "
                   "that holds none")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        spec = load_worker_spec(args.spec)
    except WorkerSpecError as e:
        for line in e.errors:
            print(f"deepfleet-worker: invalid spec: {line}", file=sys.stderr)
        return int(ExitCode.INVALID_SPEC)
    if args.export_dir and spec.export is not None:
        spec = spec.model_copy(update={"export": spec.export.model_copy(update={"dir": args.export_dir})})
    if (args.checkpoint_dir or args.resume_dir) and spec.checkpoint is None:
        print("deepfleet-worker: --checkpoint-dir/--resume-dir: the spec has no checkpoint section; drop the "
              "option or add checkpoint to the spec", file=sys.stderr)
        return int(ExitCode.INVALID_SPEC)
    if args.checkpoint_dir:
        spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"dir": args.checkpoint_dir})})
    if args.resume_dir:
        spec = spec.model_copy(update={"resume_dir": args.resume_dir})
    if args.check:
        from deepfleet.worker.rendezvous import RendezvousEnvError, resolve

        try:
            rdzv = resolve(spec, os.environ)
        except RendezvousEnvError as e:
            print(f"deepfleet-worker: {e}", file=sys.stderr)
            return int(ExitCode.INVALID_SPEC)
        exports = f", exports the model to {spec.export_dir}" if spec.export_dir is not None else ""
        checkpoints = f", checkpoints in {spec.checkpoint.dir}" if spec.checkpoint is not None else ""
        starts = f", starts from {spec.resume_dir}" if spec.resume_dir is not None else ""
        print(f"ok: job {spec.job_id} attempt {spec.attempt}, node {rdzv.node_rank} of {rdzv.nnodes} "
              f"({rdzv.platform}), {rdzv.nproc_per_node} process(es), rendezvous {rdzv.endpoint}{checkpoints}"
              f"{starts}{exports}")
        return int(ExitCode.SUCCEEDED)
    if os.environ.get(KEYVAULT_SECRETS_ENV):
        from deepfleet.worker.keyvault import KeyVaultError, resolve_secrets

        try:  # into this process's environment, which the training processes inherit
            os.environ.update(resolve_secrets(os.environ))
        except KeyVaultError as e:
            print(f"deepfleet-worker: {e}", file=sys.stderr)
            return int(ExitCode.INVALID_SPEC)
    if spec.serve is not None:
        from deepfleet.worker.serve import run_serve

        return run_serve(spec)
    from deepfleet.worker.agent import run

    return run(spec)


if __name__ == "__main__":
    sys.exit(main())
