"""What 1-bit Adam, 0/1 Adam and 1-bit LAMB share: the data-parallel group, the per-step choice between
a full-precision gradient reduction and local gradients, one `ErrorFeedback` per param group, and the
rank-local compression state a checkpoint carries.

The optimizers reduce gradients themselves once compression starts, so the ZeRO stage-0 strategy
(`engine/zero/ddp.py`) asks `reduce_gradients()` before every boundary backward: True, and its DDP hook
averages the gradients in fp32 as usual; False, and the hook leaves each rank's local gradients alone for
the optimizer to compress. The strategy hands the optimizer its process group through
`bind_process_group` (built with the optimizer in `engine/build.py`).

Error feedback is per rank and its layout depends on the world size, so it is not optimizer state keyed
by parameter: `comm_state_dict()` goes into each rank's own checkpoint file and
`load_comm_state_dict(state)` restores it when the world size matches; at another world size the
errors start from zero and the optimizer logs that it reset them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from deepfleet.engine import comm
from deepfleet.engine.onebit.allreduce import ErrorFeedback
from deepfleet.engine.optim import check_hparams

log = logging.getLogger(__name__)


class OneBitOptimizer(torch.optim.Optimizer):
    """Base of the three: subclasses write `step()` and `_reduce_at(step)` and call `_compressed_mean`."""

    def __init__(self, params: Iterable[Any], defaults: dict) -> None:
        check_hparams(defaults["lr"], defaults["betas"], defaults["weight_decay"], defaults["eps"])
        super().__init__(params, defaults)
        self.group: dist.ProcessGroup | None = None
        self.steps = 0  # optimizer steps taken (also kept per parameter, as "step", for checkpoints)
        self._feedback: dict[int, ErrorFeedback] = {}  # param group index -> its errors

    # -- the seam with the ZeRO strategy ------------------------------------------------------------

    def bind_process_group(self, group: dist.ProcessGroup | None) -> None:
        """The data-parallel group the optimizer averages over (None: the default group)."""
        self.group = group

    def reduce_gradients(self) -> bool:
        """Whether the strategy must average the gradients of the coming step in full precision."""
        return self._reduce_at(self._next_step())

    def _reduce_at(self, step: int) -> bool:
        raise NotImplementedError

    def _next_step(self) -> int:
        # After a checkpoint load the per-parameter "step" is the truth (self.steps restarts at 0).
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state and "step" in state:
                    return int(state["step"]) + 1
        return 1

    # -- compression ---------------------------------------------------------------------------------

    def _compressed_mean(self, index: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The 1-bit compressed average over the group of `tensors` (param group `index`'s), as fp32
        tensors shaped like them. With one rank, the tensors themselves (nothing to average)."""
        world = comm.get_world_size(self.group)
        if world == 1:
            return [t.float() for t in tensors]
        flat = torch.cat([t.reshape(-1).float() for t in tensors])          # (n,)
        feedback = self._feedback.get(index)
        if feedback is None or feedback.numel != flat.numel() or feedback.world_size != world:
            feedback = self._feedback[index] = ErrorFeedback(flat.numel(), world_size=world, device=flat.device)
        mean = feedback.all_reduce(flat, group=self.group)
        return [piece.view_as(t) for piece, t in zip(mean.split([t.numel() for t in tensors]), tensors, strict=True)]

    def reset_error_feedback(self) -> None:
        for feedback in self._feedback.values():
            feedback.reset()

    # -- checkpoints -----------------------------------------------------------------------------------

    def comm_state_dict(self) -> dict:
        """This rank's error feedback (world-size dependent; saved in the rank's own checkpoint file)."""
        return {"world_size": comm.get_world_size(self.group),
                "feedback": {i: f.state_dict() for i, f in self._feedback.items()}}

    def load_comm_state_dict(self, state: dict | None) -> bool:
        """Restore `comm_state_dict()`'s output; returns False (and logs) when the errors are reset
        instead: no saved state, or one saved at another world size."""
        world = comm.get_world_size(self.group)
        self._feedback.clear()
        if not state or state.get("world_size") != world:
            saved = None if not state else state.get("world_size")
            log.warning("%s: error feedback reset (saved at world size %s, now %d)",
                        type(self).__name__, saved, world)
            return False
        device = self.param_groups[0]["params"][0].device
        for index, saved_state in state["feedback"].items():
            feedback = ErrorFeedback(saved_state["numel"], world_size=world, device=device)
            feedback.load_state_dict(saved_state)
            self._feedback[int(index)] = feedback
        return True


def scalar(value: float) -> torch.Tensor:
    """A 0-dim fp32 tensor (optimizer state scalars are tensors, so checkpoints shard and load them)."""
    return torch.tensor(float(value), dtype=torch.float32)
