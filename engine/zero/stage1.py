"""ZeRO stage 1: optimizer state partitioned over each param group's data-parallel group; parameters and
full gradients replicated. What it shares with stage 2 (layout, masters, averaging, clipping, publishing,
state dicts) is `zero/partitioned.py`'s `_Partitioned`; built by `engine/build.py` through the
`StrategyFactory` signature.

Micro-steps accumulate full `p.grad` with no communication; the boundary micro-step reduces them, per
process group, chunk by chunk in place on gloo (`zero/flat.py`), bucket by bucket rank-major elsewhere
(`zero/layout.py`):

- without `overlap_comm` (DeepSpeed's default at stage 1, and its meaning: reduce after backward)
  `finish_gradients` reduces, one flat buffer alive at a time;
- with `overlap_comm` the gloo groups reduce during the boundary micro-step's backward, from
  post-accumulate-grad hooks, each chunk issued asynchronously once its gradients are final
  (`zero/boundary.py`); `finish_gradients` then only waits for the chunks still in flight. The chunks
  and their inputs are the same as after backward, so the result is bit-identical. Rank-major groups
  (other backends) reduce in `finish_gradients`, packing the next bucket while the previous one is in
  flight.

`reduce_bucket_size` bounds every chunk and bucket (a larger parameter alone). `contiguous_gradients`
holds by construction: every reduced gradient is a view of its chunk's one contiguous buffer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from deepfleet.engine.zero.boundary import BoundaryReduction
from deepfleet.engine.zero.flat import GradChunk, reduce_grads_in_place
from deepfleet.engine.zero.layout import Landing, local_rows, on_gloo, reduce_scatter
from deepfleet.engine.zero.partitioned import _MASTER_DTYPE, _Partitioned

# 16-bit training: fp32 chunk copies in flight at once during backward (double buffering)
_MIXED_IN_FLIGHT = 2


class ZeroStage1(_Partitioned):
    """ZeRO stage 1: optimizer state partitioned; full gradients kept, reduce-scattered at the boundary."""

    holds_grad_shards = False

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        compute_dtype: torch.dtype,
        zero_config: Any,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(
            model, compute_dtype=compute_dtype, zero_config=zero_config, process_group=process_group
        )
        self._boundary: BoundaryReduction | None = None
        self._hook_gradients(self._on_grad_ready if self.overlap_comm else None)

    def _on_layout(self) -> None:
        """With `overlap_comm`, the in-backward reduction of the gloo groups' flat runs."""
        self._boundary = None
        if self.overlap_comm and self._param_runs:
            self._boundary = BoundaryReduction(
                self._param_runs, self._params, bound=self._reduce_numel, dtype=_MASTER_DTYPE,
                land=self._land_chunk, staged=self._stage_flat,
                max_in_flight=_MIXED_IN_FLIGHT if self.mixed else None,
            )

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self._sync:
            return  # non-boundary micro-step: keep accumulating in p.grad
        self._ensure_layout()
        i = self._index[id(p)]
        if self._boundary is not None and self._boundary.covers(i):
            self._boundary.grad_ready(i)
            self._staged = []

    def _reduce(self) -> None:
        # Per process group, buckets in order: on gloo in place (zero/flat.py), elsewhere rank-major.
        # With overlap_comm, the next chunk or bucket is packed while the previous one is in flight (two
        # flat buffers at most); without, each flat is released before the next exists. Gloo groups whose
        # chunks the boundary backward already issued only wait for them.
        in_backward = self._boundary is not None and self._boundary.started
        with torch.no_grad():
            for q, queue in enumerate(self._queues):
                if not on_gloo(self._order[q]):
                    self._reduce_rank_major(queue)
                elif not in_backward:
                    self._reduce_in_place(self._order[q])
            if in_backward:
                self._boundary.drain()
                self._staged = []

    def zero_grad(self) -> None:
        if self._boundary is not None:
            self._boundary.abandon()  # nothing may still write into the gradients being dropped
        super().zero_grad()

    def _transient_buffers(self) -> list[torch.Tensor]:
        inflight = self._boundary.buffers() if self._boundary is not None else []
        return super()._transient_buffers() + inflight

    def _reduce_in_place(self, pg: dist.ProcessGroup | None) -> None:
        for run in self._param_runs:
            if run.group is not pg:
                continue
            chunks = reduce_grads_in_place(
                run, self._params, bound=self._reduce_numel, dtype=_MASTER_DTYPE, async_op=self.overlap_comm,
                staged=self._stage_flat,
            )
            for chunk in chunks:
                self._staged = []
                self._grad_chunks.append(chunk)
                while len(self._grad_chunks) > 1:
                    self._land_chunk(self._grad_chunks.pop(0))
        while self._grad_chunks:
            self._land_chunk(self._grad_chunks.pop(0))

    def _stage_flat(self, flat: torch.Tensor) -> None:
        self._staged = [flat]
        self._probe("reduce")

    def _land_chunk(self, chunk: GradChunk) -> None:
        """fp32: p.grad already is the reduced chunk's view; 16-bit: copy this rank's rows into the fp32
        gradient shards (p.grad stays the 16-bit gradient)."""
        chunk.wait()
        if self._grad_segments:
            for i, view in chunk.views:
                self._local_grad(i).copy_(local_rows(view, self._slots[i]))

    def _reduce_rank_major(self, queue: list[int]) -> None:
        landed: list[tuple[Landing, int, torch.Tensor]] = []
        for b in queue:
            bucket = self._reduce_buckets[b]
            flat = torch.empty(bucket.flat_numel, dtype=_MASTER_DTYPE, device=bucket.params[0].device)
            for s, p in enumerate(bucket.params):
                bucket.pack(flat, s, p.grad)
            # 16-bit: reduce straight into the fp32 shards; fp32: into a segment copied into p.grad
            segment = (
                self._grad_segments[b]
                if self._grad_segments
                else torch.empty(bucket.segment_numel, dtype=_MASTER_DTYPE, device=flat.device)
            )
            self._staged = [flat, segment]
            self._probe("reduce")
            landing = reduce_scatter(bucket, flat, segment, async_op=self.overlap_comm)
            del flat
            self._staged = []
            self._track(landing)
            landed.append((landing, b, segment))
            while landed and landed[0][0].done:
                self._land(*landed.pop(0))
        self._drain()
        for item in landed:
            self._land(*item)

    def _land(self, landing: Landing, b: int, segment: torch.Tensor) -> None:
        """In fp32 mode copy this rank's reduced rows into p.grad, where the optimizer's views point."""
        landing.wait()
        if self._grad_segments:
            return
        bucket = self._reduce_buckets[b]
        for s, p in enumerate(bucket.params):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            local_rows(p.grad, bucket.slots[s]).copy_(bucket.segment_view(segment, s))
