"""Kernel tests run Triton in its CPU interpreter, except a GPU run (`-m gpu`), where Triton must
compile for the device. Triton reads TRITON_INTERPRET when a kernel is decorated, and our Triton modules
are imported lazily on the first Triton call, so setting it here (before any test runs) is in time."""

from __future__ import annotations

import os
import re

import pytest
import torch

from tests.kernels import tolerance


def pytest_configure(config: pytest.Config) -> None:
    markexpr = config.getoption("markexpr", default="") or ""
    gpu_run = re.search(r"(?<!not )\bgpu\b", markexpr) is not None and torch.cuda.is_available()
    if not gpu_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _one_thread_and_seed():
    torch.set_num_threads(1)
    torch.manual_seed(0)


def pytest_terminal_summary(terminalreporter) -> None:
    """Print the largest error each kernel showed against its reference, per dtype."""
    if not tolerance.MAX_ERRORS:
        return
    terminalreporter.section("kernel max abs error vs reference")
    for (name, dtype), err in sorted(tolerance.MAX_ERRORS.items()):
        terminalreporter.write_line(f"{name:<36} {dtype:<10} {err:.3e}")
