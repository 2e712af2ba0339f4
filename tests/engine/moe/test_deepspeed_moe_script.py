"""DeepSpeed's CIFAR-10 MoE tutorial script (its shape: `cifar_moe_script.py`) runs on deepfleet with
only its imports changed, with expert parallelism over 2 gloo ranks and MoE param groups, and learns."""

from __future__ import annotations

import pytest

from tests.engine.moe.cifar_moe_script import spawned
from tests.spawn import spawn


@pytest.mark.parametrize("stage", [2])
def test_cifar_moe_tutorial_runs_with_imports_changed(stage: int) -> None:
    argv = ["--moe", "--ep-world-size", "2", "--num-experts", "2", "4", "--top-k", "1",
            "--noisy-gate-policy", "RSample", "--moe-param-group", "--stage", str(stage), "--epochs", "3"]
    losses = spawn(spawned, 2, argv, timeout=240)
    assert len(losses[0]) == 3 and losses[0][-1] < losses[0][0]
