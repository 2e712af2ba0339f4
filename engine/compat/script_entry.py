"""The per-rank entry `deepfleet run` launches: `python -m deepfleet.engine.compat.script_entry SCRIPT ARGS...`.

It makes `import deepspeed` resolve to deepfleet (`deepspeed_alias.install`), sets the variables
DeepSpeed's launcher gives a rank that torchrun does not (`LOCAL_SIZE`, `CROSS_RANK`, `CROSS_SIZE`),
appends `--local_rank=<n>` to the script's arguments as DeepSpeed's launcher does (unless `deepfleet run
--no_local_rank`), and runs the script as `__main__` with its own folder first on `sys.path`, as
`python SCRIPT` would.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

LOCAL_RANK_ARG_ENV = "DEEPFLEET_RUN_LOCAL_RANK_ARG"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit("usage: python -m deepfleet.engine.compat.script_entry SCRIPT [ARGS...]")
    script, args = argv[0], argv[1:]
    from deepfleet.engine.compat.deepspeed_alias import install

    install()
    local_size = os.environ.get("LOCAL_WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_SIZE", local_size)
    world, local = int(os.environ.get("WORLD_SIZE", "1")), max(int(local_size), 1)
    os.environ.setdefault("CROSS_SIZE", str(max(world // local, 1)))
    os.environ.setdefault("CROSS_RANK", str(int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")))))
    if os.environ.get(LOCAL_RANK_ARG_ENV, "1") == "1":
        args.append(f"--local_rank={os.environ.get('LOCAL_RANK', '0')}")
    path = Path(script)
    if not path.is_file():
        raise SystemExit(f"deepfleet run: {script}: no such script")
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.resolve().parent))
    runpy.run_path(str(path), run_name="__main__")
    _close_process_group()


def _close_process_group() -> None:
    """After the script returned: wait for the engines' checkpoint writes and destroy the default process
    group, so its backend's threads are joined before the interpreter tears down (a process group left
    to interpreter exit can abort the rank with "terminate called without an active exception")."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return  # the script destroyed it, or never made one
    from deepfleet.engine.checkpoint.api import _WRITERS

    for writer in list(_WRITERS.values()):  # an async save still in flight uses the writer's own group
        writer.wait()
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
