"""Every collective the engine issues, counted: torch.distributed-shaped functions, and the counterpart
of `deepspeed.comm` for user scripts (`import deepfleet.engine.comm as dist`).

Callers: the ZeRO strategies, precision (overflow agreement), the data loader, checkpointing, the
step metrics (communication bytes per step) and user scripts. Nothing in the engine calls a
`torch.distributed` collective directly; process-group construction stays in `engine/dist.py` and
`engine/parallel.py`. This is also the seam where communication compression plugs in: the strategies
reduce flat gradient buffers through `all_reduce_gradients` / `reduce_scatter_gradients`, which hand
them to the policy `set_gradient_policy` installed (`engine/gradcomp/policy.py`, built from the
`communication` section), or reduce them plainly when there is none or it declines.

Why our own module rather than torch's `CommDebugMode` or the profiler: those are debugging modes
that intercept every dispatch (or record a trace); the engine needs always-on, near-free counters it
can read every step. Each op here costs two `perf_counter` calls and a dict update — no device
synchronisation. A synchronous op's time is its wall time on this rank (on CPU/gloo that is the
collective itself; on CUDA it is the enqueue time unless the op blocks). An async op records its issue
time, and the time spent in `wait()` on the handle it returns, when the caller waits through it.

Counters: `counters() -> {op name: OpCount(count, bytes, seconds)}`, `reset_counters()`. `bytes` is
the payload this rank puts in: the input tensor's bytes (the whole input of a reduce-scatter, this
rank's shard of an all-gather, the sent tensor of send/isend, 0 for recv/irecv and for the `*_object`
calls, whose pickled size torch does not expose). A `log_name=` (DeepSpeed's argument) files the op
under that name instead of the op's own.

Names and argument names follow DeepSpeed's comm module where it has them (`tensor` for the input of
`all_gather_into_tensor`, `reduce_scatter_tensor` and `all_to_all_single`; `log_name`; `prof`, accepted
and meaningless here because every op is always counted), otherwise torch's. `get_rank` and
`get_world_size` answer 0 and 1 when no process group exists, so single-process code needs no guard.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepfleet.engine.dist import init_distributed

__all__ = [
    "OpCount",
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_gradients",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "counters",
    "gather",
    "gather_object",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "irecv",
    "is_initialized",
    "isend",
    "log_summary",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter_gradients",
    "reduce_scatter_tensor",
    "reset_counters",
    "scatter",
    "send",
    "set_gradient_policy",
]

ReduceOp = dist.ReduceOp
log = logging.getLogger(__name__)


@dataclass
class OpCount:
    """Totals for one op name on this rank since the last `reset_counters()`."""

    count: int = 0
    bytes: int = 0
    seconds: float = 0.0


# The process's counters: one table per process, like torch.distributed's own default group.
_COUNTS: dict[str, OpCount] = {}


def _record(name: str, nbytes: int, seconds: float) -> OpCount:
    entry = _COUNTS.get(name)
    if entry is None:
        entry = _COUNTS[name] = OpCount()
    entry.count += 1
    entry.bytes += nbytes
    entry.seconds += seconds
    return entry


def counters() -> dict[str, OpCount]:
    """A snapshot of this rank's per-op totals (copies; later ops do not change it)."""
    return {name: OpCount(c.count, c.bytes, c.seconds) for name, c in _COUNTS.items()}


def reset_counters() -> None:
    """Zero every counter (the step metrics read deltas instead; this is for tests and scripts)."""
    _COUNTS.clear()


def log_summary() -> None:
    """Log this rank's totals, one line per op (DeepSpeed's `comm.log_summary`)."""
    for name, c in sorted(_COUNTS.items()):
        log.info("comm %-24s count=%d bytes=%d seconds=%.6f", name, c.count, c.bytes, c.seconds)


class _TimedWork(dist.Work):
    """The Work of an async op; `wait()` through it adds the wait to the op's seconds."""

    def __init__(self, inner: dist.Work, entry: OpCount) -> None:
        super().__init__()
        self._inner = inner
        self._entry = entry

    def wait(self, timeout=None) -> bool:  # noqa: D102 — torch's Work.wait
        start = time.perf_counter()
        done = self._inner.wait() if timeout is None else self._inner.wait(timeout)
        self._entry.seconds += time.perf_counter() - start
        return done

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def is_success(self) -> bool:
        return self._inner.is_success()

    def exception(self):
        return self._inner.exception()

    def source_rank(self) -> int:
        return self._inner.source_rank()

    def result(self):
        return self._inner.result()

    def synchronize(self) -> None:
        self._inner.synchronize()

    def get_future(self) -> torch.futures.Future:
        return self._inner.get_future()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _run(name: str, nbytes: int, call, *args, async_op: bool = False, **kwargs):
    """Issue one torch collective and count it; wrap the Work of an async op."""
    start = time.perf_counter()
    work = call(*args, async_op=async_op, **kwargs) if async_op else call(*args, **kwargs)
    entry = _record(name, nbytes, time.perf_counter() - start)
    if async_op and work is not None:
        return _TimedWork(work, entry)
    return work


# -- ranks and groups ---------------------------------------------------------------------------


def is_initialized() -> bool:
    return dist.is_initialized()


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in `group` (the world by default); 0 without a process group."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    """The number of ranks in `group` (the world by default); 1 without a process group."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    """This process's rank on its node (LOCAL_RANK, set by torchrun); 0 when unset."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group: dist.ProcessGroup | None = None, group_rank: int = 0) -> int:
    """The world rank of rank `group_rank` of `group`."""
    if group is None:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def new_group(ranks: list[int] | None = None, **kwargs) -> dist.ProcessGroup:
    """A new process group over `ranks` (every rank must call it); torch's keyword arguments pass on."""
    return dist.new_group(ranks, **kwargs)


# -- collectives ---------------------------------------------------------------------------------


def barrier(group=None, async_op: bool = False, device_ids=None, *, log_name: str = "barrier", prof: bool = False):
    return _run(log_name, 0, dist.barrier, group=group, device_ids=device_ids, async_op=async_op)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op: bool = False, *, log_name: str = "all_reduce",
               prof: bool = False):
    return _run(log_name, _nbytes(tensor), dist.all_reduce, tensor, op=op, group=group, async_op=async_op)


def reduce(tensor, dst=None, op=ReduceOp.SUM, group=None, async_op: bool = False, *, group_dst=None,
           log_name: str = "reduce", prof: bool = False):
    return _run(log_name, _nbytes(tensor), dist.reduce, tensor, dst=dst, op=op, group=group,
                group_dst=group_dst, async_op=async_op)


def broadcast(tensor, src=None, group=None, async_op: bool = False, group_src=None, *, log_name: str = "broadcast",
              prof: bool = False):
    """Broadcast `tensor` from world rank `src` (or rank `group_src` of `group`); every rank counts the
    tensor's bytes."""
    return _run(log_name, _nbytes(tensor), dist.broadcast, tensor, src=src, group=group, group_src=group_src,
                async_op=async_op)


def all_gather(tensor_list, tensor, group=None, async_op: bool = False, *, log_name: str = "all_gather",
               prof: bool = False):
    return _run(log_name, _nbytes(tensor), dist.all_gather, tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor, tensor, group=None, async_op: bool = False, *,
                           log_name: str = "all_gather_into_tensor", prof: bool = False):
    """Gather every rank's `tensor` into `output_tensor` (rank-major along dim 0); torch 2.13's
    `all_gather_single` underneath (the old name warns)."""
    return _run(log_name, _nbytes(tensor), dist.all_gather_single, output_tensor, tensor, group=group,
                async_op=async_op)


def reduce_scatter_tensor(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op: bool = False, *,
                          log_name: str = "reduce_scatter_tensor", prof: bool = False):
    """Reduce `tensor` across ranks and leave this rank's dim-0 chunk in `output_tensor`; torch 2.13's
    `reduce_scatter_single` underneath (the old name warns)."""
    return _run(log_name, _nbytes(tensor), dist.reduce_scatter_single, output_tensor, tensor, op=op, group=group,
                async_op=async_op)


def all_to_all_single(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op: bool = False, *, log_name: str = "all_to_all_single", prof: bool = False):
    return _run(log_name, _nbytes(tensor), dist.all_to_all_single, output, tensor,
                output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes, group=group,
                async_op=async_op)


def gather(tensor, gather_list=None, dst=None, group=None, async_op: bool = False, *, group_dst=None,
           log_name: str = "gather", prof: bool = False):
    return _run(log_name, _nbytes(tensor), dist.gather, tensor, gather_list=gather_list, dst=dst, group=group,
                group_dst=group_dst, async_op=async_op)


def scatter(tensor, scatter_list=None, src=None, group=None, async_op: bool = False, *, group_src=None,
            log_name: str = "scatter", prof: bool = False):
    sent = sum(_nbytes(t) for t in scatter_list) if scatter_list else 0
    return _run(log_name, sent, dist.scatter, tensor, scatter_list=scatter_list, src=src, group=group,
                group_src=group_src, async_op=async_op)


# -- gradient reductions (where a compression policy plugs in) -------------------------------------

# The process's gradient compression policy (one engine per process trains; build.py sets or clears it).
_GRADIENT_POLICY: list = [None]


def set_gradient_policy(policy) -> None:  # noqa: ANN001 - duck-typed: all_reduce/reduce_scatter(...) -> Work|None
    """Install (or with None remove) the policy that compresses gradient reductions."""
    _GRADIENT_POLICY[0] = policy


def all_reduce_gradients(tensor, group=None, async_op: bool = False):
    """SUM-all-reduce a flat gradient buffer: through the installed compression policy when it takes it,
    else a plain (counted) `all_reduce`. Returns a Work with `async_op`."""
    policy = _GRADIENT_POLICY[0]
    if policy is not None:
        work = policy.all_reduce(tensor, group=group)
        if work is not None:
            return work if async_op else None
    return all_reduce(tensor, op=ReduceOp.SUM, group=group, async_op=async_op)


def gradient_policy():  # noqa: ANN201 - the installed policy object, or None
    """The installed gradient compression policy (None without one)."""
    return _GRADIENT_POLICY[0]


def compressed_reduce_scatter(output_tensor, tensor, group=None) -> bool:
    """SUM-reduce-scatter through the installed compression policy when it takes the buffer (done on
    return: True); False when there is none or it declines, and the caller reduces itself. ZeRO-3's
    FSDP2 reduce-scatter hook (zero/fsdp_collectives.py) asks this first."""
    policy = _GRADIENT_POLICY[0]
    return policy is not None and policy.reduce_scatter_into(output_tensor, tensor, group=group) is not None


def reduce_scatter_gradients(output_tensor, tensor, group=None, async_op: bool = False):
    """SUM-reduce-scatter a flat gradient buffer, compressed when the installed policy takes it."""
    policy = _GRADIENT_POLICY[0]
    if policy is not None:
        work = policy.reduce_scatter_into(output_tensor, tensor, group=group)
        if work is not None:
            return work if async_op else None
    return reduce_scatter_tensor(output_tensor, tensor, op=ReduceOp.SUM, group=group, async_op=async_op)


# -- point to point ------------------------------------------------------------------------------


def send(tensor, dst=None, group=None, tag: int = 0, *, group_dst=None, log_name: str = "send", prof: bool = False):
    return _run(log_name, _nbytes(tensor), dist.send, tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)


def recv(tensor, src=None, group=None, tag: int = 0, *, group_src=None, log_name: str = "recv", prof: bool = False):
    """Receive into `tensor`; returns the sender's rank (counted with 0 bytes: this rank sends none)."""
    return _run(log_name, 0, dist.recv, tensor, src=src, group=group, tag=tag, group_src=group_src)


def isend(tensor, dst=None, group=None, tag: int = 0, *, group_dst=None, log_name: str = "isend",
          prof: bool = False) -> dist.Work:
    start = time.perf_counter()
    work = dist.isend(tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)
    return _TimedWork(work, _record(log_name, _nbytes(tensor), time.perf_counter() - start))


def irecv(tensor, src=None, group=None, tag: int = 0, *, group_src=None, log_name: str = "irecv",
          prof: bool = False) -> dist.Work:
    start = time.perf_counter()
    work = dist.irecv(tensor, src=src, group=group, tag=tag, group_src=group_src)
    return _TimedWork(work, _record(log_name, 0, time.perf_counter() - start))


# -- picklable objects ---------------------------------------------------------------------------


def all_gather_object(object_list, obj, group=None, *, log_name: str = "all_gather_object", prof: bool = False):
    return _run(log_name, 0, dist.all_gather_object, object_list, obj, group=group)


def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None, *,
                          log_name: str = "broadcast_object_list", prof: bool = False):
    return _run(log_name, 0, dist.broadcast_object_list, object_list, src=src, group=group, device=device,
                group_src=group_src)


def gather_object(obj, object_gather_list=None, dst=None, group=None, *, group_dst=None,
                  log_name: str = "gather_object", prof: bool = False):
    return _run(log_name, 0, dist.gather_object, obj, object_gather_list=object_gather_list, dst=dst,
                group=group, group_dst=group_dst)
