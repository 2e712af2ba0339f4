"""ZeRO stage 1/2 checkpoints through `torch.distributed.checkpoint`: saved at 2 ranks with stage 2,
loaded at 3 ranks with stage 1 (fp32 and bf16) and with FSDP2 stage 3; state is identical after the
reshard and the next step continues like the run that kept going. Runs: `partitioned_runs.py`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engine.partitioned_cases import step_err
from tests.engine.partitioned_runs import scenario_runs

pytestmark = pytest.mark.slow  # one 2-rank and one 3-rank spawn, ~1 minute


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    return scenario_runs()


@pytest.mark.parametrize("kind", ["gpt", "odd", "gpt-bf16"])
def test_checkpoint_saved_at_2_ranks_stage_2_loads_at_3_ranks_stage_1(runs: dict, kind: str) -> None:
    """bf16: the model entries are the fp32 masters (Shard(0)); they and the optimizer state load
    exactly, and each replica's bf16 model is their rounding."""
    saved, loaded = runs[2][0][f"checkpoint-{kind}"], runs[3]
    for r in loaded:
        assert r[f"checkpoint-{kind}"]["published"]
        # a state dict taken before the first step creates the optimizer's state as if it never stepped
        assert r[f"checkpoint-{kind}"]["fresh"] == {"unchanged": True, "steps": {0.0}, "moments": {0.0}}
        for part in ("model", "optim"):
            assert r[f"checkpoint-{kind}"]["state"][part].keys() == saved["state"][part].keys()
        for name, value in saved["state"]["model"].items():
            assert (r[f"checkpoint-{kind}"]["state"]["model"][name] == value).all(), name
        for fqn, entries in saved["state"]["optim"].items():
            for key, value in entries.items():
                assert (r[f"checkpoint-{kind}"]["state"]["optim"][fqn][key] == value).all(), (fqn, key)
        assert r[f"checkpoint-{kind}"]["state"]["groups"] == saved["state"]["groups"]
        if kind.endswith("bf16"):
            continue  # a bf16 forward at another batch split differs by more than 1e-5
        # the next step on the same global batch agrees with the run that kept going at 2 ranks
        for name, value in saved["next"]["params"].items():
            grad = np.concatenate([run[f"checkpoint-{kind}"]["next"]["grad_rows"][name] for run in runs[2]])
            grad = torch.as_tensor(grad).reshape(value.shape)
            assert (
                step_err(r[f"checkpoint-{kind}"]["next"]["params"][name], torch.as_tensor(value), grad)
                <= 1e-5
            )


def test_checkpoint_saved_at_stage_2_loads_into_fsdp2_stage_3(runs: dict) -> None:
    saved = runs[2][0]["checkpoint-gpt"]["state"]
    for r in (run["stage3-load"] for run in runs[3]):
        assert r["model"].keys() == saved["model"].keys() and r["optim"].keys() == saved["optim"].keys()
        for name, value in saved["model"].items():
            assert (r["model"][name] == value).all(), name
        for fqn, entries in saved["optim"].items():
            for key, value in entries.items():
                assert (r["optim"][fqn][key] == value).all(), (fqn, key)
