"""FSDP2's all-gather and reduce-scatter carried as all-reduces on gloo (caller: `zero/fsdp.py`).

FSDP2 lets a caller replace the two collectives of each unit (`FSDPModule.set_custom_all_gather` and
`set_custom_reduce_scatter`, with `AllGather`/`ReduceScatter` from FSDP2's `_fsdp_api` as the interface).
Both of its buffers are already *rank-major*: the all-gather output is `[rank 0's shard | rank 1's | ...]`
with this rank's input living inside it at `rank * n`, and the reduce-scatter input is laid out so that
rank `r`'s output is elements `[r * n, (r + 1) * n)`. That is the layout `zero/layout.py` uses for stages
1 and 2, and the same trade applies: gloo's ring all-reduce beats its own all-gather and reduce-scatter
(2 ranks, 21 MB fp32: all-reduce 26 ms, reduce-scatter 59 ms, all-gather 41 ms), so

- all-gather = zero every other rank's slot of the output, all-reduce SUM it (x + 0 is exact in every
  dtype, so the result equals a real all-gather bit for bit);
- reduce-scatter = all-reduce the input in place with FSDP's op (`AVG` for fp32/bf16 gradients, `SUM`
  with FSDP's own pre/post division otherwise), then copy this rank's slice to the output.

Neither needs memory beyond the buffers FSDP allocates anyway. NCCL keeps the real collectives.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

# The interface classes are not re-exported by `torch.distributed.fsdp` in 2.13; `set_custom_*` is public.
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter


class _Empty:
    """Buffers come from the ordinary allocator (what FSDP2's default collectives do)."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class AllReduceAllGather(_Empty, AllGather):
    """All-gather of equal flat shards as one all-reduce of the zero-padded rank-major output."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        world, rank = group.size(), group.rank()
        n = input_tensor.numel()
        assert output_tensor.numel() == n * world, (output_tensor.numel(), n, world)
        with torch.no_grad():
            mine = output_tensor.narrow(0, rank * n, n)
            if n and mine.data_ptr() != input_tensor.data_ptr():  # FSDP2 copies in place already
                mine.copy_(input_tensor)
            output_tensor.narrow(0, 0, rank * n).zero_()
            output_tensor.narrow(0, (rank + 1) * n, (world - rank - 1) * n).zero_()
            return dist.all_reduce(output_tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


class _SliceAfter:
    """A pending in-place all-reduce that, on `wait()`, copies this rank's slice to the output."""

    def __init__(self, work: dist.Work, source: torch.Tensor, output: torch.Tensor) -> None:
        self._work, self._source, self._output = work, source, output

    def wait(self) -> bool:
        self._work.wait()
        self._output.copy_(self._source)
        return True


class AllReduceReduceScatter(_Empty, ReduceScatter):
    """Reduce-scatter of a rank-major flat input as one in-place all-reduce plus a slice copy. The input
    buffer is clobbered (FSDP2 only keeps it alive, never reads it back)."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> dist.Work | _SliceAfter | None:
        world, rank = group.size(), group.rank()
        n = output_tensor.numel()
        assert input_tensor.numel() == n * world, (input_tensor.numel(), n, world)
        with torch.no_grad():
            work = dist.all_reduce(input_tensor, op=op, group=group, async_op=async_op)
            pending = _SliceAfter(work, input_tensor.narrow(0, rank * n, n), output_tensor) if async_op else None
            if pending is None:
                output_tensor.copy_(input_tensor.narrow(0, rank * n, n))
            return pending
