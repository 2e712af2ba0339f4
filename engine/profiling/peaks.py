"""Peak FLOP/s per device, the denominator of MFU and HFU.

Called by `step_flops.py`. Accelerators: the vendor's dense (no sparsity) peak for the compute dtype,
from the table below, matched on the device name torch reports. CPUs: no vendor table fits every
part, so the peak is computed from what the CPU advertises: cores used (torch's intra-op threads) x
clock x FLOPs per cycle per core, the last from the widest FMA vector set in /proc/cpuinfo's flags
(two FMA ports, as on every x86 core with AVX2 or AVX-512 since Haswell/Skylake-SP): AVX-512 64 fp32
FLOPs/cycle, AVX2+FMA 32, SSE 8; bf16/fp16 on CPU count as fp32 (no native matmul rate assumed). This
is a theoretical bound, so achieved/peak stays below 1. `DEEPFLEET_PEAK_FLOPS` (FLOP/s per rank)
overrides everything, for a device this table lacks.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

PEAK_ENV = "DEEPFLEET_PEAK_FLOPS"

# device-name substring -> {dtype: dense peak FLOP/s}; first match wins, so longer names come first.
ACCELERATOR_PEAKS: tuple[tuple[str, dict[torch.dtype, float]], ...] = (
    ("H200", {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12}),
    ("H100 PCIe", {torch.bfloat16: 756e12, torch.float16: 756e12, torch.float32: 51e12}),
    ("H100", {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12}),
    ("A100", {torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 19.5e12}),
    ("A10G", {torch.bfloat16: 70e12, torch.float16: 70e12, torch.float32: 31.2e12}),
    ("L40S", {torch.bfloat16: 362e12, torch.float16: 362e12, torch.float32: 91.6e12}),
    ("L4", {torch.bfloat16: 121e12, torch.float16: 121e12, torch.float32: 30.3e12}),
    ("V100", {torch.float16: 125e12, torch.float32: 15.7e12}),
    ("MI300X", {torch.bfloat16: 1307e12, torch.float16: 1307e12, torch.float32: 163e12}),
)


def peak_flops(device: torch.device, dtype: torch.dtype, *, cpuinfo: str | None = None) -> float | None:
    """Peak FLOP/s of one rank on `device` for `dtype`; None for an accelerator not in the table."""
    override = os.environ.get(PEAK_ENV)
    if override:
        try:
            return float(override)
        except ValueError:
            raise ValueError(f"{PEAK_ENV}: {override!r} is not a number; write FLOP/s, e.g. 3.12e14") from None
    if device.type == "cpu":
        return cpu_peak_flops(torch.get_num_threads(), cpuinfo=cpuinfo)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    for key, peaks in ACCELERATOR_PEAKS:
        if key in name:
            return peaks.get(dtype, peaks.get(torch.float32))
    return None


def cpu_peak_flops(cores: int, *, cpuinfo: str | None = None) -> float:
    """cores x GHz x fp32 FLOPs per cycle, from /proc/cpuinfo (or the text given)."""
    text = cpuinfo if cpuinfo is not None else _read_cpuinfo()
    flags: set[str] = set()
    mhz = 0.0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "flags" and not flags:
            flags = set(value.split())
        elif key == "cpu MHz":
            mhz = max(mhz, float(value))
    if "avx512f" in flags:
        per_cycle = 64
    elif "avx2" in flags and "fma" in flags:
        per_cycle = 32
    else:
        per_cycle = 8
    ghz = mhz / 1000 if mhz else 3.0  # no clock reported (some VMs, non-x86): assume 3 GHz
    return cores * ghz * 1e9 * per_cycle


def _read_cpuinfo() -> str:
    path = Path("/proc/cpuinfo")
    return path.read_text() if path.exists() else ""
