"""ZeRO stage 1's boundary reduction inside backward, on gloo (caller: `zero/stage1.py`'s `ZeroStage1`
with `overlap_comm`).

Stage 1 keeps full gradients through the accumulation window and reduces them once, on the boundary
micro-step. Without `overlap_comm` (DeepSpeed's default at stages 1/2, and its meaning: reduce after
backward) that reduction runs in `finish_gradients`, inside the optimizer step, after backward. With
`overlap_comm` it runs from the parameters' post-accumulate-grad hooks during the boundary micro-step's
backward (DeepSpeed's stage 1 reduces in its hooks only on the boundary micro-step too), so the
all-reduces overlap the rest of backward and the step only waits for what is still in flight:

- the chunks are exactly those of the after-backward path (`zero/flat.py`'s `chunks` over each flat
  run, at most `reduce_bucket_size` elements), so each all-reduce has the same input and the reduced
  gradients are bit-identical to it;
- a chunk is issued, asynchronously, once every one of its parameters has its final gradient for the
  window (the hook fires after the boundary backward accumulated into `p.grad`); chunks of one run are
  issued strictly from the last to the first, the order backward produces them, so every rank issues
  the same collective sequence on each process group;
- the end of backward (an autograd callback) issues, in the same order, every chunk whose parameters
  got no gradient in this backward (a parameter used by no micro-step is reduced as zeros, as after
  backward);
- `drain()` (from `finish_gradients`) waits for the chunks in issue order and lands them.

In fp32 each chunk's buffer *is* the gradient storage from then on (`p.grad` a view of it), so nothing is
transient beyond the chunk being packed. In 16-bit mode the fp32 chunk is a transient copy of 16-bit
gradients; there at most `max_in_flight` chunks are in flight: issuing one more lands the oldest first
(its rows copied into the fp32 gradient shards, its buffer released), the double buffering of the
after-backward path.

A gradient that reaches an already-issued chunk (a second backward on the boundary micro-step, or
several backward passes per window with sync on) would add into a buffer in flight: it raises, naming
the fix. Non-boundary micro-steps (sync off) never reach this module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from deepfleet.engine.zero.flat import GradChunk, Member, ParamRun, chunks, reduce_chunk


class BoundaryReduction:
    """The in-backward reduction of one strategy's flat runs (see the module docstring)."""

    def __init__(
        self,
        runs: Sequence[ParamRun],
        params: Sequence[torch.Tensor],
        *,
        bound: int,
        dtype: torch.dtype,
        land: Callable[[GradChunk], None],
        staged: Callable[[torch.Tensor], None],
        max_in_flight: int | None,
    ) -> None:
        self._runs = list(runs)
        self._params = params
        self._dtype = dtype
        self._land = land
        self._staged = staged
        self._max_in_flight = max_in_flight
        # per run, its chunks in registration order (issued from the last one back)
        self._plans: list[list[tuple[Member, ...]]] = [list(chunks(run.members, bound)) for run in self._runs]
        self._where = {
            m.index: (q, c) for q, plan in enumerate(self._plans) for c, chunk in enumerate(plan) for m in chunk
        }
        self.in_flight: list[GradChunk] = []
        self._reset()

    def _reset(self) -> None:
        self._next = [len(plan) - 1 for plan in self._plans]  # per run: the next chunk to issue
        self._ready: list[list[set[int]]] = [[set() for _ in plan] for plan in self._plans]
        self._callback_queued = False
        self.started = False  # a chunk was issued in this window

    def covers(self, index: int) -> bool:
        """Whether parameter `index` (in the strategy's list) lives in one of the runs."""
        return index in self._where

    def grad_ready(self, index: int) -> None:
        """Parameter `index` holds its final gradient for the window: issue every chunk now complete."""
        q, c = self._where[index]
        if c > self._next[q]:
            raise RuntimeError(
                "zero_optimization.overlap_comm at stage 1: a gradient reached a bucket already being "
                "reduced (a second backward on the accumulation-boundary micro-step); run one backward "
                "per micro-step, or set zero_optimization.overlap_comm to false"
            )
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
            self._callback_queued = True
        self._ready[q][c].add(index)
        plan = self._plans[q]
        while self._next[q] >= 0 and len(self._ready[q][self._next[q]]) == len(plan[self._next[q]]):
            self._issue(q)

    def _issue(self, q: int) -> None:
        chunk = self._plans[q][self._next[q]]
        self._next[q] -= 1
        self.started = True
        reduced = reduce_chunk(self._runs[q], chunk, self._params, dtype=self._dtype, async_op=True,
                               staged=self._staged)
        self.in_flight.append(reduced)
        if self._max_in_flight is not None:
            while len(self.in_flight) > self._max_in_flight:
                self._land(self.in_flight.pop(0))

    def flush(self) -> None:
        """Issue, in order, every chunk not issued yet (the end of backward; also the step's fallback)."""
        self._callback_queued = False
        for q in range(len(self._plans)):
            while self._next[q] >= 0:
                self._issue(q)

    def drain(self) -> None:
        """Land every chunk in issue order and start the next window."""
        self.flush()
        while self.in_flight:
            self._land(self.in_flight.pop(0))
        self._reset()

    def abandon(self) -> None:
        """Wait for whatever is in flight without landing it (gradients are being dropped)."""
        while self.in_flight:
            self.in_flight.pop(0).wait()
        self._reset()

    def buffers(self) -> list[torch.Tensor]:
        """Chunk buffers in flight (reported as gradient memory)."""
        return [chunk.flat for chunk in self.in_flight]
