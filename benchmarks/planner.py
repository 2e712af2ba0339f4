"""Planner accuracy: the per-rank peak-memory estimate of `deepfleet plan` against the high-water mark
measured on 2 gloo ranks over a steady training step, for ZeRO stages 0-3 x activation checkpointing
on/off x two model sizes, and stages 1-3 with the optimizer state offloaded to NVMe files (the runs of `tests/engine/planner_runs.py`). One JSON line per config and a
summary line with the largest error.

Usage: .venv/bin/python benchmarks/planner.py
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from deepfleet.engine.config import load_config
    from deepfleet.engine.planner.estimate import Choice, estimate
    from deepfleet.engine.planner.profile import profile_model
    from tests.engine.planner_runs import SIZES, engine_config, gpt, measure_table
    from tests.spawn import spawn

    cases = [(size, stage, ckpt) for size in SIZES for stage in range(4) for ckpt in (False, True)]
    cases += [(size, stage, ckpt, "nvme") for size in SIZES for stage in (1, 2, 3) for ckpt in (False, True)]
    nvme = tempfile.mkdtemp(prefix="planner-nvme-")
    try:
        measured = spawn(measure_table, 2, cases, nvme, timeout=600)
    finally:
        shutil.rmtree(nvme, ignore_errors=True)
    profiles = {size: profile_model(gpt, {"size": size}) for size in SIZES}
    worst = 0.0
    for i, (size, stage, ckpt, *offload) in enumerate(cases):
        prof = profiles[size]
        device = offload[0] if offload else "none"
        choice = Choice(stage=stage, offload_optimizer=device,
                        checkpoint=tuple(range(len(prof.blocks))) if ckpt else ())
        cfg = load_config(engine_config(stage, nvme_path=nvme if offload else None), world_size=2)
        est = estimate(prof, cfg, world_size=2, choice=choice)
        peak = max(r[i]["peak"] for r in measured)
        error = (est.total - peak) / peak
        worst = max(worst, abs(error))
        print(json.dumps({"bench": "planner", "model": size, "params": prof.num_params, "stage": stage,
                          "checkpoint": ckpt, "offload_optimizer": device, "measured_bytes": peak, "planned_bytes": round(est.total),
                          "error": round(error, 4)}), flush=True)
    print(json.dumps({"bench": "planner_summary", "configs": len(cases), "max_abs_error": round(worst, 4)}))


if __name__ == "__main__":
    main()
