"""Autotuner vs a hand grid: `deepfleet tune`'s chosen config against the best of every ZeRO stage x
activation checkpointing (off, every block) x micro-batch size measured by hand, same trial runner (`engine/planner/trial.py`: a few timed steps on
2 gloo ranks), same model (the medium tiny GPT of `tests/engine/planner_runs.py`) and budget.

Prints one JSON line per hand-grid config, the tuner's experiments, and a summary line: the tuner's
pick, its tokens/s, the grid's best and the ratio (how close the tuner got), and trials used by each.

At the default budget the medium GPT fits stage 0 only at small micro-batches unless its blocks are
checkpointed, so the checkpointing dimension is one the grid and the tuner both have to weigh.

Usage: .venv/bin/python benchmarks/autotune.py [--quick] [--budget-gib 0.012] [--world-size 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODEL = "tests.engine.planner_runs:gpt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-gib", type=float, default=0.012)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--size", default="medium")
    ap.add_argument("--grid-micro", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=3, help="head-to-head re-measurements of pick and grid best")
    ap.add_argument("--quick", action="store_true", help="a smaller hand grid (micro-batch 1, 4, 8) and one repeat")
    args = ap.parse_args()
    if args.quick:
        args.grid_micro, args.repeats = "1,4,8", 1

    from deepfleet.engine.config import load_config
    from deepfleet.engine.planner.estimate import GIB, Choice, estimate
    from deepfleet.engine.planner.profile import profile_model
    from deepfleet.engine.planner.tune import Experiment, _config, _name, subprocess_runner, tune

    kwargs = {"size": args.size}
    prof = profile_model(MODEL, kwargs)
    work = Path(tempfile.mkdtemp(prefix="autotune-bench-"))
    steps = {"start_profile_step": 2, "end_profile_step": 5}
    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "steps_per_print": 10**9}
    run = subprocess_runner(model=MODEL, model_args=kwargs, world_size=args.world_size, exps_dir=work / "grid",
                            start=steps["start_profile_step"], end=steps["end_profile_step"], metric_path=None)
    cfg = load_config(base, world_size=args.world_size)
    grid: list[tuple[str, float]] = []
    grid_exps: dict[str, Experiment] = {}
    every_block = tuple(range(len(prof.blocks)))
    for stage in range(4):
        for ckpt in ((), every_block):
            for mb in (int(m) for m in args.grid_micro.split(",")):
                choice = Choice(stage=stage, checkpoint=ckpt)
                need = estimate(prof, cfg, world_size=args.world_size, choice=choice, micro_batch=mb).total
                if need > args.budget_gib * GIB:
                    continue  # the hand grid keeps to the budget too
                exp = Experiment(name=_name(choice, mb), choice=choice, micro_batch=mb, gas=1, predicted_bytes=need,
                                 config=_config(base, choice, mb, 1, search_checkpointing=True))
                metric = run(exp, {})
                grid.append((exp.name, metric["throughput"]))
                grid_exps[exp.name] = exp
                print(json.dumps({"bench": "autotune_grid", "config": exp.name,
                                  "tokens_per_s": round(metric["throughput"]), "planned_bytes": round(need)}),
                      flush=True)
    tuned_cfg = {**base, "autotuning": {"enabled": True, "results_dir": str(work / "results"),
                                        "exps_dir": str(work / "exps"), **steps}}
    result = tune(tuned_cfg, MODEL, world_size=args.world_size, budget_gib=args.budget_gib, factory_kwargs=kwargs,
                  profile=prof)
    for e in result.experiments:
        print(json.dumps({"bench": "autotune_trial", "config": e.name,
                          "tokens_per_s": round(e.metric["throughput"]) if e.metric else None, "error": e.error}),
              flush=True)
    best_name, best_tps = max(grid, key=lambda g: g[1])
    pick = result.best
    pick_in_grid = dict(grid).get(pick.name) if pick else None
    # Trials on a shared machine are noisy: measure the pick and the grid's best again, alternating, and
    # compare medians.
    head: dict[str, list[float]] = {}
    if pick:
        by_name = {e.name: e for e in result.experiments}
        grid_best = grid_exps[best_name]
        grid_best = Experiment(name=best_name + "_again", choice=grid_best.choice, micro_batch=grid_best.micro_batch,
                               gas=1, predicted_bytes=grid_best.predicted_bytes, config=grid_best.config)
        again = subprocess_runner(model=MODEL, model_args=kwargs, world_size=args.world_size,
                                  exps_dir=work / "again", start=2, end=8, metric_path=None)
        for _ in range(args.repeats):
            for label, exp in (("pick", by_name[pick.name]), ("grid_best", grid_best)):
                head.setdefault(label, []).append(again(exp, {})["throughput"])
        for label, values in head.items():
            print(json.dumps({"bench": "autotune_head_to_head", "who": label, "tokens_per_s": [round(v) for v in values]}),
                  flush=True)
    print(json.dumps({"bench": "autotune_summary", "budget_gib": args.budget_gib, "params": prof.num_params,
                      "tuner_pick": pick.name if pick else None,
                      "tuner_pick_checkpoints": bool(pick.choice.checkpoint) if pick else None,
                      "grid_best_checkpoints": bool(grid_exps[best_name].choice.checkpoint),
                      "tuner_tokens_per_s": round(pick.metric["throughput"]) if pick else None,
                      "pick_tokens_per_s_in_grid": round(pick_in_grid) if pick_in_grid else None,
                      "grid_best": best_name, "grid_best_tokens_per_s": round(best_tps),
                      "tuner_vs_grid_best": round(pick.metric["throughput"] / best_tps, 3) if pick else None,
                      "head_to_head_median_ratio": round(_median(head["pick"]) / _median(head["grid_best"]), 3)
                      if head else None,
                      "tuner_trials": len(result.experiments), "grid_trials": len(grid),
                      "pruned_by_planner": len(result.pruned)}), flush=True)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


if __name__ == "__main__":
    main()
