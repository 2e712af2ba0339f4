"""FSDP2's reduce-scatter as a ring of point-to-point sends on gloo (caller: `zero/fsdp.py`).

FSDP2 lets a caller replace the reduce-scatter of each unit (`FSDPModule.set_custom_reduce_scatter`, with
`ReduceScatter` from FSDP2's `_fsdp_api` as the interface). Its input is *rank-major*: `world` equal
chunks of `n` elements, rank `r`'s result being the reduction of chunk `r` over all ranks. Gloo's own
`reduce_scatter` is slow on CPU; measured here with 2 ranks on one block of the 27M-parameter benchmark
GPT (12.6 MB fp32 input, median of 40, interleaved): gloo reduce-scatter 188 ms, an all-reduce of the
input plus a slice copy 103 ms, this ring 54 ms (gloo's all-gather of the same size: 56 ms, so FSDP2's
all-gather stays torch's). A ring reduce-scatter is the bandwidth-optimal algorithm: in `world - 1`
steps every rank sends one chunk to its right neighbour and adds the chunk arriving from its left one,
so each rank moves `(world - 1) * n` elements each way and chunk `r` ends fully reduced on rank `r`.

The input buffer is clobbered (FSDP2 only keeps it alive, never reads it back); the only extra memory is
one chunk to receive into. `AVG` (what FSDP2 passes for fp32/bf16 gradients) divides the sum by the world
size; `SUM` is left as is (FSDP2 then divides itself). The sum is taken in the buffer's dtype, as gloo's
reduce-scatter does. The sends go through `engine/comm.py` (counted there as `isend`/`irecv`). NCCL keeps
the real collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

# The interface class is not re-exported by `torch.distributed.fsdp` in 2.13; `set_custom_*` is public.
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from deepfleet.engine import comm
from deepfleet.engine.comm import compressed_reduce_scatter, reduce_scatter_tensor

_TAG = 0x5253  # keeps these sends apart from any other point-to-point traffic on the same group


def ring_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002 - torch's collective argument name
    *,
    group: dist.ProcessGroup,
    op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
) -> None:
    """Reduce-scatter a rank-major flat `input` (world * n elements) into `output` (n elements) with SUM
    or AVG, by a ring of sends (see the module docstring). Blocking; `input` is clobbered."""
    world, rank = group.size(), group.rank()
    n = output.numel()
    if input.numel() != n * world:
        raise ValueError(f"reduce-scatter input has {input.numel()} elements, expected {world} x {n}")
    if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        raise ValueError(f"ring reduce-scatter supports SUM and AVG, not {op}")
    with torch.no_grad():
        chunks = input.view(world, n)  # (world, n): chunk i is what rank i ends up holding
        if n and world > 1:
            right, left = (rank + 1) % world, (rank - 1) % world
            incoming = torch.empty(n, dtype=input.dtype, device=input.device)
            for step in range(world - 1):
                # Send the chunk accumulated so far; receive the left neighbour's partial sum of the next.
                sent = comm.isend(chunks[(rank - step - 1) % world], group=group, tag=_TAG, group_dst=right)
                received = comm.irecv(incoming, group=group, tag=_TAG, group_src=left)
                received.wait()
                sent.wait()
                chunks[(rank - step - 2) % world].add_(incoming)
        if op == dist.ReduceOp.AVG:
            torch.div(chunks[rank], world, out=output)
        else:
            output.copy_(chunks[rank])


class RingReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter hook running `ring_reduce_scatter`; buffers come from the ordinary
    allocator, as with FSDP2's default."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> None:
        # FSDP2 issues its reduce-scatter synchronously; an async request is served synchronously
        # too (the returned None tells FSDP2 there is nothing to wait for). A gradient compression policy
        # (`communication` section, engine/gradcomp/) takes the buffer first: FSDP2's layout is rank-major,
        # so rank r's chunk of the flat buffer is its shard, which is the policy's reduce-scatter layout.
        if op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) and compressed_reduce_scatter(
                output_tensor, input_tensor, group=group):
            if op == dist.ReduceOp.AVG:
                output_tensor.div_(dist.get_world_size(group))
            return
        self._reduce_scatter(output_tensor, input_tensor, group=group, op=op)

    @staticmethod
    def _reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, *, group: dist.ProcessGroup, op: object) -> None:
        """The uncompressed reduction: the ring of sends."""
        ring_reduce_scatter(output, tensor, group=group, op=op)


class CompressedReduceScatter(RingReduceScatter):
    """The hook on backends other than gloo when a compression policy is installed: the policy's
    compressed reduce-scatter, else the backend's own `reduce_scatter_tensor`."""

    @staticmethod
    def _reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, *, group: dist.ProcessGroup, op: object) -> None:
        reduce_scatter_tensor(output, tensor, op=op, group=group)
