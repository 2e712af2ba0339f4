"""Launch one node's training processes under torch.distributed.elastic, and map the outcome to the
worker exit-code contract.

Callers: `worker/cli.py` (`run(spec)`, in the worker process) and torch's elastic agent, which starts
`python -m deepfleet.worker.agent` once per local rank (`child_main`, the training process: it runs
the user script with runpy or the managed loop of worker/train.py and turns what it raised into an
exit code). Built on `torch.distributed.launcher.api.elastic_launch` (torchrun's agent, c10d
rendezvous, `--nnodes MIN:MAX`, in-place group restarts); what is ours is the environment contract
and the exit-code mapping, which torchrun does not have (it exits 1 for any failure).

Node 0 hosts the c10d rendezvous store, so the group survives the loss of any node but that one
(then the attempt fails with COMM_FAILURE and the controller starts a new one).
When the attempt succeeds and the spec asks for an export, node 0's worker then writes the model of
the newest complete checkpoint to safetensors (worker/export.py) before it exits.

Always sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with torch's default (workers reuse the agent's
rendezvous TCPStore) a restarted group fails or hangs in init_process_group on this torch version
(pytorch#135712); with it, restarts recover.
"""

from __future__ import annotations

import json
import math
import os
import runpy
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import FrameType

from deepfleet.worker.rendezvous import Rendezvous, RendezvousEnvError, bind_store, resolve
from deepfleet.worker.signals import MARKER_ENV
from deepfleet.worker.spec import (
    SPEC_ENV,
    TOKEN_ENV,
    ExitCode,
    FailureClass,
    FailureReport,
    RestartPolicy,
    ScriptEntrypoint,
    WorkerSpec,
    WorkerSpecError,
    classify_exit,
    load_worker_spec,
    signal_exit_code,
)

# Set in every training process: the file a process writes its exit code to when the restart policy
# does not retry its failure (the worker then ends the attempt instead of restarting the group).
FINAL_MARKER_ENV = "DEEPFLEET_FINAL_MARKER"

# The engine builds the sinks this names at initialize (engine/metrics.py); the heartbeat's posts steps.
STEP_SINKS_ENV = "DEEPFLEET_STEP_SINKS"
HEARTBEAT_SINK = "deepfleet.worker.heartbeat:step_sink"

# Which failure decides the worker's exit code when ranks fail differently: the root cause usually
# fails first and differently (one rank raises, its peers then time out in a collective).
_PRECEDENCE = [
    FailureClass.INVALID_SPEC,
    FailureClass.OOM,
    FailureClass.USER_ERROR,
    FailureClass.NODE_LOST,
    FailureClass.COMM_FAILURE,
    FailureClass.UNKNOWN,
]
_CONTRACT_CODES = {int(c) for c in ExitCode}


def _normal_code(code: int) -> int:
    """A child's exit status as a worker exit code: signal deaths (-N) become 128+N."""
    return signal_exit_code(-code) if code < 0 else code


def exit_code_for_failures(codes: Iterable[int]) -> int:
    """The worker's exit code for a failed group, from the failed ranks' exit statuses. Pure."""
    # A training process that exited with a status of its own (not ours, not a signal) is the user's
    # code failing: count it as a user error before ranking, so a peer's follow-on abort cannot outrank it.
    normal = [
        c if c in _CONTRACT_CODES or c > 128 else int(ExitCode.USER_ERROR)
        for c in (_normal_code(c) for c in codes if c != 0)
    ]
    if not normal:
        return int(ExitCode.SUCCEEDED)
    if all(c == ExitCode.PREEMPTED for c in normal):
        return int(ExitCode.PREEMPTED)
    by_class = {classify_exit(c): c for c in reversed(normal)}  # first occurrence wins
    for cls in _PRECEDENCE:
        if cls in by_class:
            code = by_class[cls]
            return code if code in _CONTRACT_CODES or code > 128 else int(ExitCode.USER_ERROR)
    return int(ExitCode.USER_ERROR)


def exit_code_for_exception(exc: BaseException) -> int:
    """The exit code of a training process that raised `exc`."""
    names = {c.__name__ for c in type(exc).__mro__}
    if isinstance(exc, WorkerSpecError) or (
        "ConfigError" in names and type(exc).__module__.startswith("deepfleet.engine")
    ):
        return int(ExitCode.INVALID_SPEC)
    if "DistError" in names or "RendezvousError" in names:
        return int(ExitCode.COMM_FAILURE)
    cls = classify_exit(int(ExitCode.USER_ERROR), log_tail=f"{type(exc).__name__}: {exc}")
    return {FailureClass.OOM: ExitCode.OOM, FailureClass.COMM_FAILURE: ExitCode.COMM_FAILURE}.get(
        cls, ExitCode.USER_ERROR
    ).value


# ---------------------------------------------------------------------------------------------- node side
def launch_config(spec: WorkerSpec, rdzv: Rendezvous):
    """torchrun's LaunchConfig for this node (the `torchrun --nnodes MIN:MAX ...` flags, as an object)."""
    from torch.distributed.launcher.api import LaunchConfig

    rv = spec.rendezvous
    return LaunchConfig(
        min_nodes=rdzv.min_nodes,
        max_nodes=rdzv.max_nodes,
        nproc_per_node=rdzv.nproc_per_node,
        run_id=rdzv.run_id,
        role="trainer",
        rdzv_endpoint=rdzv.endpoint,
        rdzv_backend=rv.backend,
        rdzv_configs={  # torch reads these as whole seconds
            "join_timeout": math.ceil(rv.join_timeout_s),
            "last_call_timeout": math.ceil(rv.last_call_timeout_s),
            "close_timeout": math.ceil(rv.close_timeout_s),
            "keep_alive_interval": rv.keep_alive_interval_s,
            "keep_alive_max_attempt": rv.keep_alive_max_attempts,
            # Node 0 hosts the rendezvous store: say so rather than let torch guess from hostnames,
            # which fails when the endpoint is a Service DNS name.
            "is_host": rdzv.node_rank == 0,
        },
        # In-place restarts: capped by the policy; a failure it does not retry stops the group at once
        # (the child writes the final marker, see _end_attempt).
        max_restarts=spec.restart.in_place_budget,
        monitor_interval=spec.monitor_interval_s,
        start_method="spawn",
        # SIGTERM -> workers checkpoint at their next step boundary; SIGKILL only after the grace period.
        shutdown_timeout=math.ceil(spec.preemption.grace_period_s),
    )


def child_environment(spec: WorkerSpec, *, marker: Path, final: Path, cpu: bool) -> dict[str, str]:
    """Variables the training processes inherit from this worker."""
    # The worker watches the notice file itself (see _watch_notice_file): a training process that
    # stopped on its own would look like a failure to the agent and be restarted.
    child_spec = spec.model_copy(update={"preemption": spec.preemption.model_copy(update={"notice_file": None})})
    env = {
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        # The token travels in DEEPFLEET_TOKEN only, never inside the spec text.
        SPEC_ENV: child_spec.model_dump_json(exclude={"heartbeat": {"token"}}),
        MARKER_ENV: str(marker),
        FINAL_MARKER_ENV: str(final),
        "DEEPFLEET_JOB_ID": spec.job_id,
        "DEEPFLEET_ATTEMPT": str(spec.attempt),
    }
    if spec.heartbeat.token:
        env[TOKEN_ENV] = spec.heartbeat.token
    env.update(job_environment(spec))
    if cpu:
        env["OMP_NUM_THREADS"] = "1"
    env.update(spec.env)
    return env


def job_environment(spec: WorkerSpec, *, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What the job hands its training code (names in `deepfleet.engine.job_env`): the engine config, the
    checkpoint directory and the step budget; and, for a script, the heartbeat step sink the engine
    loads, so a script's steps reach the controller as the managed loop's do (progress, loss, hang
    detection, the checkpoint named at preemption)."""
    from deepfleet.engine import job_env  # torch-free

    env: dict[str, str] = {}
    if spec.engine_config is not None:
        config = spec.engine_config
        env[job_env.ENGINE_CONFIG_ENV] = config if isinstance(config, str) else json.dumps(config)
    if spec.checkpoint is not None:
        env[job_env.CHECKPOINT_DIR_ENV] = spec.checkpoint.dir
        if spec.checkpoint.every_steps:
            env[job_env.CHECKPOINT_EVERY_ENV] = str(spec.checkpoint.every_steps)
    if spec.max_steps is not None:
        env[job_env.MAX_STEPS_ENV] = str(spec.max_steps)
    if isinstance(spec.entrypoint, ScriptEntrypoint) and spec.heartbeat.url:
        current = (os.environ if environ is None else environ).get(STEP_SINKS_ENV, "")
        if HEARTBEAT_SINK not in current.split(","):
            env[STEP_SINKS_ENV] = ",".join(filter(None, [current, HEARTBEAT_SINK]))
    return env


def check_engine_config(spec: WorkerSpec, *, world_size: int) -> list[str]:
    """Validate the spec's engine config before any process starts (torch's agent would otherwise
    restart a group that can never start). Returns the problems, one line each; [] when valid or unset."""
    if spec.engine_config is None:
        return []
    from deepfleet.engine.config import ConfigError, load_config  # torch-free

    try:
        load_config(spec.engine_config, world_size=world_size)
    except ConfigError as e:
        return [f"engine_config.{line}" for line in e.errors]
    except (OSError, ValueError) as e:
        return [f"engine_config: {e}".replace("\n", " ")]
    return []


def _watch_notice_file(path: str | Path, stop: threading.Event, *, interval_s: float = 0.5) -> None:
    # Turn the notice into SIGTERM to ourselves: torch's agent then forwards it to the training
    # processes and waits the grace period, the same path as a real SIGTERM. The final marker takes
    # the same path: it ends the attempt before the agent can restart the group in place.
    while not stop.wait(interval_s):
        if os.path.exists(path):
            os.kill(os.getpid(), signal.SIGTERM)
            return


def _raise_signal_exception(signum: int, frame: FrameType | None) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    raise SignalException(f"process {os.getpid()} got signal {signum}", sigval=signal.Signals(signum))


def run(spec: WorkerSpec, *, environ: Mapping[str, str] | None = None) -> int:
    """Run this node's share of the job to the end; return the worker exit code."""
    environ = os.environ if environ is None else environ
    try:
        rdzv = resolve(spec, environ)
    except RendezvousEnvError as e:
        print(f"deepfleet-worker: {e}", file=sys.stderr)
        return int(ExitCode.INVALID_SPEC)

    problems = check_engine_config(spec, world_size=rdzv.world_size)
    if problems:
        for line in problems:
            print(f"deepfleet-worker: invalid engine config: {line}", file=sys.stderr)
        return int(ExitCode.INVALID_SPEC)
    if spec.resume_dir is not None and spec.checkpoint is not None:
        from deepfleet.worker.resume import seed_from

        try:  # the source checkpoint the backend mounted read-only, copied into this job's own dir
            tag = seed_from(spec.resume_dir, into=spec.checkpoint.dir)
        except OSError as e:
            print(f"deepfleet-worker: checkpoint.resumeFrom: cannot copy from {spec.resume_dir}: {e}",
                  file=sys.stderr)
            return int(ExitCode.INVALID_SPEC)
        if tag is not None:
            print(f"deepfleet-worker: starting from checkpoint {tag} of job {spec.checkpoint.resume_from} "
                  f"({spec.resume_dir})", file=sys.stderr, flush=True)

    import torch
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    workdir = Path(tempfile.mkdtemp(prefix=f"deepfleet-{spec.job_id}-"))
    marker, final = workdir / "preempted", workdir / "final"
    os.environ.update(child_environment(spec, marker=marker, final=final, cpu=not torch.cuda.is_available()))
    stop = threading.Event()
    # Until torch's agent installs its own handlers (when the processes start), SIGTERM during the
    # rendezvous would kill this process outright; make it the same exception torch raises.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_signal_exception)
    threading.Thread(target=_watch_notice_file, args=(final, stop), kwargs={"interval_s": 0.1},
                     name="deepfleet-final", daemon=True).start()
    if spec.preemption.notice_file:
        threading.Thread(target=_watch_notice_file, args=(spec.preemption.notice_file, stop),
                         name="deepfleet-notice", daemon=True).start()
    try:
        # node 0's store server (port 0 only) stays open through the launch: torch's handler reuses it
        rdzv, _server = bind_store(rdzv, timeout_s=spec.rendezvous.join_timeout_s)
    except RendezvousEnvError as e:
        print(f"deepfleet-worker: {e}", file=sys.stderr)
        return int(ExitCode.INVALID_SPEC)
    print(f"deepfleet-worker: job {spec.job_id} attempt {spec.attempt} node {rdzv.node_rank}/{rdzv.nnodes} "
          f"({rdzv.platform}), rendezvous {rdzv.endpoint} run {rdzv.run_id}", file=sys.stderr, flush=True)
    try:
        elastic_launch(launch_config(spec, rdzv), sys.executable)("-u", "-m", "deepfleet.worker.agent")
        if spec.export is not None and rdzv.node_rank == 0:
            from deepfleet.worker.export import export_model

            export_model(spec)  # a failed export is in its manifest; training's result stands
        return int(ExitCode.SUCCEEDED)
    except ChildFailedError as e:
        code = exit_code_for_failures(f.exitcode for f in e.failures.values())
        print(f"deepfleet-worker: training failed ({classify_exit(code).value}, exit {code})",
              file=sys.stderr, flush=True)
        return code
    except SignalException as e:
        if final.exists():
            code = int(final.read_text() or ExitCode.USER_ERROR)
            print(f"deepfleet-worker: training failed ({classify_exit(code).value}, exit {code}); "
                  "the restart policy does not retry it, so the group is not restarted", file=sys.stderr, flush=True)
            return code
        if marker.exists():
            print(f"deepfleet-worker: preempted; checkpoint {marker.read_text() or '(none)'} is complete",
                  file=sys.stderr, flush=True)
            return int(ExitCode.PREEMPTED)
        return signal_exit_code(int(e.sigval))
    except RendezvousError as e:
        print(f"deepfleet-worker: rendezvous failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return int(ExitCode.COMM_FAILURE)
    finally:
        stop.set()
        shutil.rmtree(workdir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- process side
def _run_script(entry: ScriptEntrypoint) -> None:
    script = os.path.abspath(entry.script)
    if not os.path.isfile(script):
        raise WorkerSpecError([f"entrypoint.script: {entry.script!r} does not exist; give the path of the "
                               "training script relative to the working directory"])
    args = list(entry.args)
    if entry.deepspeed:  # what `deepfleet run` does for the script (engine/compat/script_entry.py)
        from deepfleet.engine.compat.deepspeed_alias import install

        install()
        args.append(f"--local_rank={os.environ.get('LOCAL_RANK', '0')}")
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(script))  # as `python script.py` would
    runpy.run_path(script, run_name="__main__")


def _report(spec: WorkerSpec | None, code: int, exc: BaseException) -> None:
    if spec is None or spec.heartbeat.failure_url is None:
        return
    from deepfleet.worker.heartbeat import HeartbeatReporter

    message = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:4000]
    HeartbeatReporter(spec.heartbeat).report_failure(
        FailureReport(rank=int(os.environ.get("RANK", "0")), failure_class=classify_exit(code), message=message)
    )


def _end_attempt(spec: WorkerSpec | None, code: int) -> int:
    # A failure the restart policy does not retry (64 invalid spec, 77 OOM, 65 unless retryOnUserError)
    # must not be re-run by the elastic agent's in-place restarts: tell the worker through the final
    # marker, which it turns into the end of the attempt. Returns `code`.
    path = os.environ.get(FINAL_MARKER_ENV)
    policy = spec.restart if spec is not None else RestartPolicy()
    if code != ExitCode.SUCCEEDED and path and not policy.retries(classify_exit(code)):
        Path(path).write_text(str(code))
    return code


def _die_with_parent() -> None:
    # torch's agent starts training processes in their own sessions, so a worker killed outright
    # (SIGKILL, the OOM killer) would leave them training on as orphans; on Linux, ask the kernel
    # to SIGKILL this process when the worker goes, as if the node went down with it.
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)


def child_main() -> int:
    """One training process: run the entrypoint, return its exit code (the contract's, not Python's)."""
    _die_with_parent()
    spec: WorkerSpec | None = None
    try:
        spec = load_worker_spec()
        if isinstance(spec.entrypoint, ScriptEntrypoint):
            _run_script(spec.entrypoint)
        else:
            from deepfleet.worker.train import run_managed

            run_managed(spec)
        return int(ExitCode.SUCCEEDED)
    except SystemExit as e:
        if e.code is None or e.code == 0:
            return int(ExitCode.SUCCEEDED)
        if isinstance(e.code, int) and e.code in _CONTRACT_CODES:
            return _end_attempt(spec, e.code)
        print(f"training exited with {e.code!r}", file=sys.stderr, flush=True)
        return _end_attempt(spec, int(ExitCode.USER_ERROR))
    except BaseException as e:  # the training code's failure becomes an exit code and a report
        code = exit_code_for_exception(e)
        if code == ExitCode.INVALID_SPEC:  # the user's input: one line per problem, no traceback
            for line in getattr(e, "errors", None) or [str(e)]:
                print(f"deepfleet-worker: invalid spec: {line}", file=sys.stderr, flush=True)
        else:
            traceback.print_exc()
        _report(spec, code, e)
        return _end_attempt(spec, code)


if __name__ == "__main__":
    sys.exit(child_main())
