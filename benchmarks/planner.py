"""Planner accuracy: the per-rank peak-memory estimate of `deepfleet plan` against the high-water mark
measured on 2 gloo ranks over a steady training step, for ZeRO stages 0-3 x activation checkpointing
on/off x two model sizes (the runs of `tests/engine/planner_runs.py`). One JSON line per config and a
summary line with the largest error.

Usage: .venv/bin/python benchmarks/planner.py
"""

from __future__ import annotations

import json
import sys
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
    measured = spawn(measure_table, 2, cases, timeout=600)
    profiles = {size: profile_model(gpt, {"size": size}) for size in SIZES}
    worst = 0.0
    for i, (size, stage, ckpt) in enumerate(cases):
        prof = profiles[size]
        choice = Choice(stage=stage, checkpoint=tuple(range(len(prof.blocks))) if ckpt else ())
        est = estimate(prof, load_config(engine_config(stage), world_size=2), world_size=2, choice=choice)
        peak = max(r[i]["peak"] for r in measured)
        error = (est.total - peak) / peak
        worst = max(worst, abs(error))
        print(json.dumps({"bench": "planner", "model": size, "params": prof.num_params, "stage": stage,
                          "checkpoint": ckpt, "measured_bytes": peak, "planned_bytes": round(est.total),
                          "error": round(error, 4)}), flush=True)
    print(json.dumps({"bench": "planner_summary", "configs": len(cases), "max_abs_error": round(worst, 4)}))


if __name__ == "__main__":
    main()
