"""Kernel tests run Triton in its CPU interpreter: the variable must be set before any kernel module is
imported (Triton reads it when `@triton.jit` decorates), so it is set here, at collection time."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.kernels import tolerance  # noqa: E402


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
