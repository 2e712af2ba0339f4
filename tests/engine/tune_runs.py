"""Runs for `test_tune.py`: the autotuner measuring real in-process trials on gloo ranks (every rank
tunes the same way, `tune.inprocess_runner`), and then a fresh engine trained with its pick."""

from __future__ import annotations

from typing import Any

from tests.engine.planner_runs import gpt

MODEL = "tests.engine.planner_runs:gpt"


def tune_then_train(rank: int, world_size: int, base: dict[str, Any], budget_gib: float, nvme_path: str) -> dict:
    """Tune `base` within `budget_gib` (NVMe offload possible under `nvme_path`), then train the picked
    config from scratch for 4 steps on one batch; returns the pick, its config and the losses."""
    import torch

    import deepfleet.engine as deepfleet
    from deepfleet.engine.planner.profile import build, profile_model
    from deepfleet.engine.planner.tune import inprocess_runner, tune

    result = tune(base, MODEL, world_size=world_size, budget_gib=budget_gib,
                  runner=inprocess_runner(lambda: build(gpt, {"size": "small"}, device="cpu"), start=1, end=2),
                  profile=profile_model(gpt, {"size": "small"}), accelerator=False, write=rank == 0,
                  nvme_path=nvme_path)
    best = result.best
    assert best is not None, [e.error for e in result.experiments]
    job = gpt("small", seed=1)
    model, data = job["model"], job["training_data"]
    engine, *_ = deepfleet.initialize(model=model, model_parameters=model.parameters(), config=best.config)
    micro = best.config["train_micro_batch_size_per_gpu"]
    batch = torch.utils.data.default_collate([data[(rank * micro + i) % len(data)] for i in range(micro)])
    losses = []
    for _ in range(4):
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    files = sorted(p.name for p in engine.sharding.offload.directory.iterdir()) \
        if getattr(engine.sharding, "offload", None) is not None else []
    return {"best": best.name, "config": best.config, "losses": losses, "nvme_files": files,
            "tried": [e.name for e in result.experiments], "errors": [e.error for e in result.experiments],
            "recompute": [c.recompute for c in engine.checkpointing]}
