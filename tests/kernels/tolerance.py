"""Per-dtype tolerances for comparing a kernel with its reference, and a record of the errors seen.

Both sides compute in fp32 and round once to the output dtype, so the tolerances are about one or two
units in the last place of that dtype. The Triton CPU interpreter rounds fp32 -> bf16 toward zero (GPUs
round to nearest even), which can add one more bf16 ulp.
"""

from __future__ import annotations

import torch

TOLERANCES = {  # dtype -> (atol, rtol)
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}

MAX_ERRORS: dict[tuple[str, str], float] = {}


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, *, scale: float = 1.0) -> None:
    """assert_close with the tolerance of `expected`'s dtype times `scale`; records the max abs error."""
    atol, rtol = TOLERANCES[expected.dtype]
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    err = (actual.double() - expected.double()).abs().max().item() if expected.numel() else 0.0
    key = (name, str(expected.dtype).removeprefix("torch."))
    MAX_ERRORS[key] = max(MAX_ERRORS.get(key, 0.0), err)
    torch.testing.assert_close(actual, expected, atol=atol * scale, rtol=rtol * scale, msg=lambda m: f"{name}: {m}")
