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


@pytest.mark.parametrize("first", ["import deepfleet.engine.engine", "deepspeed.init_distributed()", "pass"])
def test_deepspeed_moe_layer_is_an_attribute_whatever_was_imported_first(first: str) -> None:
    """`deepspeed.moe.layer.MoE` resolves in a fresh interpreter after the engine has loaded the moe
    package for its own use (then the package's lazy attribute hook no longer runs)."""
    import subprocess
    import sys

    code = f"import deepfleet.engine as deepspeed\n{first}\nprint(deepspeed.moe.layer.MoE.__name__, deepspeed.moe.utils.__name__)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["MoE", "deepfleet.engine.moe.utils"]
