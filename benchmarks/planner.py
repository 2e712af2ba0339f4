"""Planner accuracy: the per-rank peak-memory estimate of `deepfleet plan` against the high-water mark
measured on 2 gloo ranks over a steady training step, for ZeRO stages 0-3 x activation checkpointing
on/off x two model sizes, stages 1-3 with the optimizer state offloaded to NVMe files, and stage 3 with
the parameter shards there too (the runs of `tests/engine/planner_runs.py`, whose tracker follows FSDP2's
in-place resizes). One JSON line per config and a
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
    from tests.engine.planner_runs import measure_table, planned, profile, table_cases
    from tests.spawn import spawn

    cases = table_cases()
    nvme = tempfile.mkdtemp(prefix="planner-nvme-")
    try:
        measured = spawn(measure_table, 2, cases, nvme, timeout=600)
        worst = 0.0
        for i, case in enumerate(cases):
            size, stage, ckpt, *offload = case
            est = planned(case, nvme)
            peak = max(r[i]["peak"] for r in measured)
            error = (est.total - peak) / peak
            worst = max(worst, abs(error))
            print(json.dumps({"bench": "planner", "model": size, "params": profile(size).num_params, "stage": stage,
                              "checkpoint": ckpt, "offload_optimizer": "nvme" if offload else "none",
                              "offload_param": "nvme" if offload == ["nvme-param"] else "none",
                              "measured_bytes": peak, "planned_bytes": round(est.total), "phase": est.peak_phase,
                              "error": round(error, 4)}), flush=True)
    finally:
        shutil.rmtree(nvme, ignore_errors=True)
    print(json.dumps({"bench": "planner_summary", "configs": len(cases), "max_abs_error": round(worst, 4)}))


if __name__ == "__main__":
    main()
