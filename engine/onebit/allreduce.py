"""The 1-bit compressed all-reduce with error feedback (worker and server error) of 1-bit Adam, 0/1 Adam
and 1-bit LAMB.

Called by the three optimizers in `engine/onebit/` on their momentum (or, in 0/1 Adam, gradients and
accumulated updates) once their full-precision warm-up is over. Torch has no compressed collective, so
this one is written on two counted collectives of `engine/comm.py`, with the sign bits packed and
unpacked by `deepfleet.kernels.onebit_pack` (Triton on CUDA, the pure-torch reference on the CPU).

Two phases, as in the 1-bit Adam paper (Tang et al., 2021), for a flat fp32 buffer x of n elements on
each of W ranks (n a multiple of W * chunk, see `padded_numel`):
  1. worker: c = x + worker_error; each chunk of `chunk` elements becomes sign bits and one scale
     (the chunk's mean |c|, the least-squares scale for its signs); worker_error <- c - decompressed.
     Segment s (the s-th of W equal slices of the buffer) of every rank's bits and scales goes to rank s
     (`all_to_all_single`: n/8 bytes of bits plus 4n/chunk bytes of scales out of each rank).
  2. server: rank s averages the W decompressed copies of its segment, adds server_error, compresses
     the sum the same way (server_error <- remainder), and every rank gathers every segment's bits and
     scales (`all_gather_into_tensor`: n/(8W) bytes of bits plus 4n/(chunk W) bytes of scales in).
The result, identical on every rank, satisfies (exactly, up to fp32 rounding)
  result = mean_r(x_r + worker_error_r(before) - worker_error_r(after)) + server_error(before) - server_error(after)
with server_error the concatenation of the ranks' segments: the errors carry what compression dropped
into the next call. Against an fp32 all-reduce (4n bytes in per rank) the bytes are
(1/8 + 4/chunk)(1 + 1/W) / 4 of it: 1/21 at W = 2 with the default chunk of 2048.

DeepSpeed scales each whole tensor by ||c|| / sqrt(n); one scale per chunk of the flat buffer (here)
follows each tensor's magnitude without a per-tensor collective and costs 4 bytes per 2048 elements.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from deepfleet.engine import comm
from deepfleet.kernels.onebit_pack import onebit_pack, onebit_unpack

MAX_CHUNK = 2048  # elements per scale; a multiple of 8 (the kernel packs whole bytes)


def chunk_size(numel: int, world_size: int) -> int:
    """Elements per scale for a buffer of `numel` elements over `world_size` ranks: MAX_CHUNK, or less
    for a small buffer (one chunk per rank's segment), so padding stays below one chunk per rank."""
    per_rank = -(-numel // world_size)
    return max(8, min(MAX_CHUNK, -(-per_rank // 8) * 8))


def padded_numel(numel: int, world_size: int, chunk: int) -> int:
    """`numel` rounded up to a multiple of world_size * chunk (every rank's segment is whole chunks)."""
    step = world_size * chunk
    return -(-numel // step) * step


def compressed_all_reduce(
    buffer: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    *,
    chunk: int,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The average of `buffer` over `group`, 1-bit compressed both ways (see the module docstring).

    buffer: (n,) fp32, n a multiple of W * chunk; worker_error: (n,) fp32; server_error: (n / W,) fp32;
    both errors are updated in place. Returns a new (n,) fp32 tensor, identical on every rank.
    Raises ValueError on shapes that do not fit."""
    world = comm.get_world_size(group)
    n = buffer.numel()
    if n % (world * chunk) or worker_error.numel() != n or server_error.numel() != n // world:
        raise ValueError(
            f"compressed_all_reduce: buffer of {n} elements needs a multiple of {world} * {chunk}, a worker "
            f"error of {n} and a server error of {n // world}; got {worker_error.numel()} and {server_error.numel()}"
        )
    segment = n // world
    # phase 1: compress the whole buffer, send segment s to rank s
    bits, scales = onebit_pack(buffer, worker_error, chunk_size=chunk)           # (n/8,) uint8, (n/chunk,)
    bits_in, scales_in = torch.empty_like(bits), torch.empty_like(scales)        # row j = rank j's copy
    comm.all_to_all_single(bits_in, bits, group=group, log_name="onebit_all_to_all")
    comm.all_to_all_single(scales_in, scales, group=group, log_name="onebit_all_to_all")
    copies = onebit_unpack(bits_in, scales_in, numel=n, chunk_size=chunk).view(world, segment)
    mean = copies.mean(0)                                                        # (segment,)
    # phase 2: compress this rank's averaged segment, gather every segment
    seg_bits, seg_scales = onebit_pack(mean, server_error, chunk_size=chunk)     # (segment/8,), (segment/chunk,)
    all_bits = seg_bits.new_empty(n // 8)
    all_scales = seg_scales.new_empty(n // chunk)
    comm.all_gather_into_tensor(all_bits, seg_bits, group=group, log_name="onebit_all_gather")
    comm.all_gather_into_tensor(all_scales, seg_scales, group=group, log_name="onebit_all_gather")
    return onebit_unpack(all_bits, all_scales, numel=n, chunk_size=chunk)


class ErrorFeedback:
    """The worker and server errors of one flat buffer of `numel` elements on this rank of a group of
    `world_size` ranks, and the compressed all-reduce over them (one per optimizer param group)."""

    def __init__(self, numel: int, *, world_size: int, device: torch.device | str = "cpu") -> None:
        self.numel = numel
        self.world_size = world_size
        self.chunk = chunk_size(numel, world_size)
        padded = padded_numel(numel, world_size, self.chunk)
        self.worker_error = torch.zeros(padded, dtype=torch.float32, device=device)
        self.server_error = torch.zeros(padded // world_size, dtype=torch.float32, device=device)

    def all_reduce(self, flat: torch.Tensor, *, group: dist.ProcessGroup | None) -> torch.Tensor:
        """The compressed average of `flat` ((numel,) any float dtype) as a (numel,) fp32 tensor."""
        padded = torch.zeros_like(self.worker_error)
        padded[: self.numel] = flat.reshape(-1)
        return compressed_all_reduce(padded, self.worker_error, self.server_error, chunk=self.chunk,
                                     group=group)[: self.numel]

    def reset(self) -> None:
        self.worker_error.zero_()
        self.server_error.zero_()

    def state_dict(self) -> dict:
        return {"numel": self.numel, "world_size": self.world_size, "chunk": self.chunk,
                "worker_error": self.worker_error.clone(), "server_error": self.server_error.clone()}

    def load_state_dict(self, state: dict) -> None:
        """Restore errors saved at the same world size and buffer size; ValueError otherwise."""
        if (state["numel"], state["world_size"], state["chunk"]) != (self.numel, self.world_size, self.chunk):
            raise ValueError(
                f"error feedback saved for {state['numel']} elements on {state['world_size']} ranks, "
                f"this buffer has {self.numel} on {self.world_size}"
            )
        self.worker_error.copy_(state["worker_error"])
        self.server_error.copy_(state["server_error"])
