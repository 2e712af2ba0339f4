"""Kernel test fixtures. Triton runs in its CPU interpreter except in a GPU run (`-m gpu`); the switch
is set in `tests/conftest.py`, before any module can import triton."""

from __future__ import annotations

import pytest
import torch

from tests.kernels import tolerance


@pytest.fixture(autouse=True)
def _one_thread_and_seed():
    torch.set_num_threads(1)
    torch.manual_seed(0)


# opcheck's aot-dispatch test retraces the op; on the (slow) interpreter the schema, autograd-registration
# and fake-tensor tests are kept and the retrace is checked once, on the reference path.
OPCHECK_TESTS = {
    "torch": ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    "triton": ("test_schema", "test_autograd_registration", "test_faketensor"),
}


@pytest.fixture(params=["torch", "triton"])
def opcheck(request):
    """opcheck(op, args) under one implementation (the test runs once per implementation)."""
    impl = request.param

    def run(op, args) -> None:
        from deepfleet.kernels._dispatch import force_impl

        with force_impl(impl):
            torch.library.opcheck(op, args, test_utils=OPCHECK_TESTS[impl])

    return run


def pytest_terminal_summary(terminalreporter) -> None:
    """Print the largest error each kernel showed against its reference, per dtype."""
    if not tolerance.MAX_ERRORS:
        return
    terminalreporter.section("kernel max abs error vs reference")
    for (name, dtype), err in sorted(tolerance.MAX_ERRORS.items()):
        terminalreporter.write_line(f"{name:<36} {dtype:<10} {err:.3e}")
