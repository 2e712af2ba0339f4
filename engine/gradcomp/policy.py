"""The `communication` compression policy: block-quantized (int8/int4) gradient reductions with error
feedback, a convergence guard, and the fallback to uncompressed reductions.

Built by `engine/build.py` from the `communication` section and installed in `engine/comm.py`
(`set_gradient_policy`), whose `all_reduce_gradients` / `reduce_scatter_gradients` every strategy that
reduces flat gradient buffers calls (stage 0's DDP hooks, stages 1/2's buckets); the engine calls
`end_step(loss)` after each optimizer step and puts what it returns into the step metrics.
Torch has no compressed collective (its PowerSGD and fp16 DDP hooks are DDP-only), so this is our own,
on counted `all_to_all_single` and `all_gather_into_tensor` calls.

A SUM all-reduce of a flat fp32 buffer x over W ranks, as two quantized phases (ZeRO++'s qgZ shape):
  1. c = x + error[bucket]; codes, scales = quantize(c); error[bucket] = c - decoded (error feedback);
     segment s of every rank's codes and scales goes to rank s, which decodes and sums them;
  2. the summed segment (plus its own server error) is quantized again and every rank gathers all
     segments. A reduce-scatter stops after phase 1.
Buckets are told apart by their order within a step and their size, the same every step.

Guard: every `guard.interval` steps each compressed reduction also runs uncompressed on the same
bucket (the uncompressed result is the one used that step); the largest relative error
||compressed - exact|| / ||exact|| and the change of the rank-averaged loss since the previous check go
into the step metrics. Past `max_relative_error`, or a loss increase past `max_loss_increase`, the
policy falls back to uncompressed reductions for the rest of the run and logs why (all ranks decide
on replicated numbers, so they agree).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from deepfleet.engine import comm
from deepfleet.engine.gradcomp import quantize as codec_module

log = logging.getLogger(__name__)


class BlockCodec:
    """int8/int4 block quantization (`quantize.py`); the policy's `codec` (a test may swap in another)."""

    def __init__(self, *, bits: int, block: int) -> None:
        self.bits, self.block = bits, block

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return codec_module.quantize(x, bits=self.bits, block=self.block)

    def decode(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return codec_module.dequantize(codes, scales, bits=self.bits, block=self.block)


class _Done:
    """The Work of a reduction that already finished (the compressed path is synchronous)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result([self._tensor])
        return future


class GradientCompression:
    """See the module docstring. `config` is a `CommunicationConfig` with compression int8 or int4."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.codec = BlockCodec(bits=8 if config.compression == "int8" else 4, block=config.block_size)
        self.active = True
        self.steps = 0                          # optimizer steps ended
        self._calls = 0                         # reductions in the current step
        self._worker: dict[tuple, torch.Tensor] = {}
        self._server: dict[tuple, torch.Tensor] = {}
        self._errors: list[float] = []          # this step's checked relative errors
        self._checked_loss: float | None = None
        self.fallback_reason: str | None = None

    # -- what engine/comm.py calls ----------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, *, group: Any) -> Any:
        """SUM-all-reduce `tensor` in place, compressed; returns a finished Work, or None when this policy
        does not handle it (inactive, one rank, or not a flat fp32 buffer) and the caller reduces."""
        if not self._handles(tensor, group):
            return None
        exact = tensor.clone() if self._checking() else None
        result = self._reduce(tensor, group=group, gather=True)
        if exact is not None:
            comm.all_reduce(exact, group=group, log_name="grad_guard_exact")
            result = self._check(result, exact, group=group)
        tensor.copy_(result)
        return _Done(tensor)

    def reduce_scatter_into(self, output: torch.Tensor, tensor: torch.Tensor, *, group: Any) -> Any:
        """SUM-reduce `tensor` and leave this rank's dim-0 chunk in `output`, compressed; None as above."""
        if not self._handles(tensor, group) or tensor.numel() % comm.get_world_size(group):
            return None
        exact = tensor.clone() if self._checking() else None
        segment = self._reduce(tensor, group=group, gather=False)   # (n / W,)
        if exact is not None:
            exact_out = torch.empty_like(output)
            comm.reduce_scatter_tensor(exact_out, exact, group=group, log_name="grad_guard_exact")
            segment = self._check(segment, exact_out.view(-1), group=group)
        output.view(-1).copy_(segment)
        return _Done(output)

    # -- what the engine calls -----------------------------------------------------------------------

    def end_step(self, loss: float | None) -> dict:
        """After each optimizer step: run the loss side of the guard; returns the step-metrics fields."""
        figures: dict[str, Any] = {"comm_compressed": self.active}
        if self._errors:
            figures["comm_compression_error"] = max(self._errors)
            delta = self._loss_delta(loss)
            figures["comm_loss_delta"] = delta
            guard = self.config.guard
            if figures["comm_compression_error"] > guard.max_relative_error:
                self._fall_back(f"relative error {figures['comm_compression_error']:.3g} > "
                                f"guard.max_relative_error {guard.max_relative_error}")
            elif delta is not None and delta > guard.max_loss_increase:
                self._fall_back(f"loss rose by {delta:.3g} of its value since the last check > "
                                f"guard.max_loss_increase {guard.max_loss_increase}")
        self.steps += 1
        self._calls = 0
        self._errors = []
        return figures

    # -- internals ----------------------------------------------------------------------------------

    def _handles(self, tensor: torch.Tensor, group: Any) -> bool:
        return (self.active and comm.get_world_size(group) > 1 and tensor.dtype == torch.float32
                and tensor.is_contiguous() and tensor.numel() > 0)

    def _checking(self) -> bool:
        interval = self.config.guard.interval
        return bool(interval) and (self.steps + 1) % interval == 0

    def _check(self, result: torch.Tensor, exact: torch.Tensor, *, group: Any) -> torch.Tensor:
        """Record the relative error of `result` against the uncompressed `exact` (reduced here for an
        all-reduce; already reduced for a reduce-scatter) and return the exact one, which this step uses."""
        if exact.numel() != result.numel():
            raise AssertionError(f"guard: compressed {result.numel()} vs exact {exact.numel()} elements")
        norm = float(exact.norm())
        self._errors.append(float((result - exact).norm()) / norm if norm > 0 else 0.0)
        return exact

    def _loss_delta(self, loss: float | None) -> float | None:
        if loss is None:
            return None
        mean = torch.tensor([float(loss)], dtype=torch.float64)
        comm.all_reduce(mean, log_name="grad_guard_loss")
        mean_loss = float(mean) / comm.get_world_size()
        previous, self._checked_loss = self._checked_loss, mean_loss
        if previous is None or previous == 0:
            return None
        return (mean_loss - previous) / abs(previous)

    def _fall_back(self, reason: str) -> None:
        self.active = False
        self.fallback_reason = reason
        log.warning("communication compression: %s at step %d; falling back to uncompressed gradient reductions",
                    reason, self.steps + 1)

    def _reduce(self, tensor: torch.Tensor, *, group: Any, gather: bool) -> torch.Tensor:
        """Phase 1 (and with `gather` phase 2) of the module docstring. The buffer is laid out as W rows,
        row r = elements [r * per, (r + 1) * per) padded to whole blocks, so rank r's segment is exactly
        its reduce-scatter chunk. Returns the (n,) sum, or this rank's (n / W,) chunk of it."""
        world = comm.get_world_size(group)
        n, block = tensor.numel(), self.codec.block
        per = -(-n // world)
        per_pad = -(-per // block) * block
        key = (self._calls, n, gather)
        self._calls += 1
        flat = tensor.reshape(-1)
        c = torch.zeros(world, per_pad, dtype=torch.float32, device=tensor.device)   # (W, per_pad)
        for r in range(world):
            piece = flat[r * per:(r + 1) * per]
            c[r, :piece.numel()] = piece
        c = c.view(-1)
        feedback = self.config.error_feedback
        if feedback and key in self._worker:
            c += self._worker[key]
        codes, scales = self.codec.encode(c)
        if feedback:
            self._worker[key] = c - self.codec.decode(codes, scales)
        codes_in, scales_in = torch.empty_like(codes), torch.empty_like(scales)
        comm.all_to_all_single(codes_in, codes, group=group, log_name="grad_quantized_all_to_all")
        comm.all_to_all_single(scales_in, scales, group=group, log_name="grad_quantized_all_to_all")
        segment = self.codec.decode(codes_in, scales_in).view(world, per_pad).sum(0)   # (per_pad,)
        if not gather:
            return segment[:per]
        if feedback and key in self._server:
            segment += self._server[key]
        seg_codes, seg_scales = self.codec.encode(segment)
        if feedback:
            self._server[key] = segment - self.codec.decode(seg_codes, seg_scales)
        all_codes = seg_codes.new_empty(codes.numel())
        all_scales = seg_scales.new_empty(scales.numel())
        comm.all_gather_into_tensor(all_codes, seg_codes, group=group, log_name="grad_quantized_all_gather")
        comm.all_gather_into_tensor(all_scales, seg_scales, group=group, log_name="grad_quantized_all_gather")
        rows = self.codec.decode(all_codes, all_scales).view(world, per_pad)
        return torch.cat([rows[r, :max(0, min(per, n - r * per))] for r in range(world)])
