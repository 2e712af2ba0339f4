"""Suite-wide setup that must happen before any test module is imported.

Triton runs in its CPU interpreter except in a GPU run (`-m gpu` with a CUDA device). The interpreter
switch is read when `triton` is first imported (its standard library is decorated then), and some test
modules import it during collection, so it is set here, at the very start of the session.
"""

from __future__ import annotations

import os
import re

import pytest


def pytest_configure(config: pytest.Config) -> None:
    markexpr = config.getoption("markexpr", default="") or ""
    if re.search(r"(?<!not )\bgpu\b", markexpr) is None:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    else:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
    # Triton 3.9 warns on the first real compile unless FP fusion is chosen explicitly; warnings are errors.
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
