"""A stand-in for `deepfleet-worker` that attacks its host from inside a job, for the isolation tests.

It records, in `probe.json` in its working directory, what it was given (environment, user, session,
working directory) and what it could do with the paths in its entrypoint args: `--read P` (open and
read a file or list a directory), `--write P` (create a file), `--environ PID` (read a process's
environment). Each outcome is "ok" or the error's name. Then it exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from deepfleet.worker.spec import load_worker_spec


def _try(action) -> str:
    try:
        action()
        return "ok"
    except OSError as e:
        return type(e).__name__


def _read(path: str) -> None:
    p = Path(path)
    if p.is_dir():
        os.listdir(p)
    else:
        p.read_bytes()


def main() -> int:
    spec = load_worker_spec()
    p = argparse.ArgumentParser()
    p.add_argument("--read", action="append", default=[])
    p.add_argument("--write", action="append", default=[])
    p.add_argument("--environ", action="append", default=[])
    args = p.parse_args(spec.entrypoint.args)
    report = {
        "env": dict(os.environ),
        "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
        "sid": os.getsid(0), "pid": os.getpid(), "cwd": os.getcwd(),
        "read": {path: _try(lambda path=path: _read(path)) for path in args.read},
        "write": {path: _try(lambda path=path: Path(path).write_text("x")) for path in args.write},
        "environ": {pid: _try(lambda pid=pid: Path(f"/proc/{pid}/environ").read_bytes()) for pid in args.environ},
        "checkpoint_dir": spec.checkpoint.dir if spec.checkpoint else None,
    }
    Path(f"probe-{os.environ.get('DEEPFLEET_NODE_RANK', '0')}.json").write_text(json.dumps(report))
    print("probe done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
