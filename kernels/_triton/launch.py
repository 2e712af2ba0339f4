"""Launch geometry shared by the Triton kernels in this folder (block sizes, program counts).

Called by the launchers in `kernels/_triton/*.py`; imports only torch and triton.
"""

from __future__ import annotations

import torch
import triton


def row_block(n_cols: int) -> int:
    """Power-of-two block covering a row of `n_cols` elements (at least 16)."""
    return max(16, triton.next_power_of_2(n_cols))


def elementwise_block(device: torch.device) -> int:
    """Elements per program of an elementwise kernel: GPU-sized on CUDA; larger under the CPU interpreter,
    whose cost is per program, not per element."""
    return 1024 if device.type == "cuda" else 8192


def rows_per_block(block: int) -> int:
    """Rows one program handles together when rows are short (a (rows, block) tile of <= 4096 values)."""
    return max(1, min(16, 4096 // block))


def num_warps(block: int) -> int:
    """Warps for a program holding `block` fp32 values per tensor: enough threads to keep registers low."""
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


def reduction_programs(device: torch.device, n_rows: int) -> int:
    """How many programs share a reduction over rows (e.g. a weight gradient): a few per SM on CUDA."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(n_rows, 4 * sms))
    return max(1, min(n_rows, 4))  # the interpreter runs programs one by one; few programs is fastest


def flatten_rows(t: torch.Tensor) -> torch.Tensor:
    """(..., n) -> contiguous (rows, n)."""
    return t.reshape(-1, t.shape[-1]).contiguous()
