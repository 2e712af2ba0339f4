"""`deepfleet tune CONFIG --model FACTORY --budget-gib G [--nvme-path DIR]`: choose ZeRO stage,
micro-batch size, activation checkpointing and offload for the most tokens/s within the budget (the
config's `autotuning` section sets the search), and write the winning config to
`autotuning.results_dir/ds_config_optimal.json`.

Run by the `deepfleet` CLI as its own process (`python -m deepfleet.engine.planner.tune_cli`), so the
CLI stays torch-free. Prints one line per experiment and the winner, or the summary as JSON with
`--json`; exits 2 on bad input (one line naming the key or option and the fix), 1 when no experiment
ran to completion.
"""

from __future__ import annotations

import argparse
import json
import sys

from deepfleet.engine.planner.cli import _kwargs, add_common_options, one_line_errors


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="deepfleet tune", description=__doc__.splitlines()[0])
    add_common_options(ap, world_size_help="ranks per trial")
    ap.add_argument("--nvme-path", default=None, metavar="DIR",
                    help="directory for optimizer-state NVMe offload; makes that offload a choice when the budget needs it")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from deepfleet.engine.planner.tune import tune

    result = one_line_errors(lambda: tune(args.config, args.model, world_size=args.world_size,
                                          budget_gib=args.budget_gib, factory_kwargs=_kwargs(args.model_arg),
                                          nvme_path=args.nvme_path))
    if result is None:
        return 2
    if args.json:
        print(json.dumps(result.summary()))
    else:
        for exp in result.experiments:
            value = exp.metric.get(result.metric) if exp.metric else None
            shown = f"{value:.4g}" if value is not None else f"failed: {exp.error}"
            print(f"{exp.name:28s} predicted {exp.predicted_bytes / 2**20:9.1f} MiB  {result.metric} {shown}")
        for p in result.pruned:
            print(f"pruned {p['choice']}: {p['reason']}")
        if result.best:
            print(f"best: {result.best.name} -> {result.optimal_config_path}")
    return 0 if result.best else 1


if __name__ == "__main__":
    sys.exit(main())
