"""The one helper that runs a function on N gloo ranks in separate processes.

Every multi-process test uses `spawn(fn, world_size, *args)`: each rank gets a gloo process group with a
short timeout, one intra-op thread (two ranks with two threads each on a 2-core box run ~15x slower),
and its result (any picklable value) comes back in rank order. A rank that raises makes the call raise
with that rank's traceback; a hang makes it raise after `timeout` seconds and kills every rank.
`fn` must be importable by module path (a module-level function in a test module).

The ranks meet at a TCPStore that the parent process has already bound to port 0 and keeps open, so the
chosen port is handed over, never picked and bound later (no race with other tests for the port).

Ranks are forked from a forkserver that has imported torch and the engine once (per test process),
not started as fresh interpreters: importing torch costs each fresh rank ~3 s of CPU, which made a
two-rank call that does nothing take ~10 s on a loaded 2-core machine (~0.1 s from the forkserver). The
forkserver's children do not inherit the caller's state, so each rank takes the caller's environment,
working directory and sys.path at the call, as a spawned process would.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, out: Any,
           parent: tuple[dict[str, str], str, list[str]]) -> None:
    environ, cwd, path = parent
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.path[:] = path
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        result = fn(rank, world_size, *args)
        # Pickled to bytes here: torch's queue reducers would share tensor storage through file
        # descriptors that vanish when this process exits before the parent reads the queue.
        out.put((rank, True, pickle.dumps(result)))
    except BaseException:  # report every failure to the parent, then exit non-zero
        out.put((rank, False, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_CONTEXT: Any = None


def _context() -> Any:
    """The forkserver context, its preload set before its server first starts."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "deepfleet.engine.engine", "tests.spawn"])
    return _CONTEXT


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the results by rank."""
    import torch.distributed as dist

    ctx = _context()
    out = ctx.Queue()
    # The parent holds the rendezvous store (bound to port 0) for the ranks' whole life.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    port = store.port
    parent = (dict(os.environ), os.getcwd(), list(sys.path))
    procs = [
        ctx.Process(target=_entry, args=(fn, rank, world_size, port, args, out, parent), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"spawn({fn.__name__}, {world_size}) did not finish in {timeout:.0f}s")
            try:
                rank, ok, value = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and not errors:
                    # a rank died without reporting (e.g. a signal); give the others a moment to report
                    time.sleep(1.0)
                    if out.empty():
                        codes = {i: p.exitcode for i, p in enumerate(procs)}
                        raise RuntimeError(f"rank process died without a report; exit codes {codes}") from None
                continue
            if ok:
                results[rank] = pickle.loads(value)
            else:
                errors[rank] = value
            if errors:
                break
        if errors:
            rank = min(errors)
            raise RuntimeError(f"rank {rank} of {world_size} failed:\n{errors[rank]}")
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        return [results[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        del store
