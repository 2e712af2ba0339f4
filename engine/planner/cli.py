"""`deepfleet plan CONFIG --model FACTORY`: per-rank peak memory and step-time factors for every ZeRO
stage x offload x checkpointing choice, before anything is launched.

Run by the `deepfleet` CLI as its own process (`python -m deepfleet.engine.planner.cli`), so the CLI
stays torch-free. Prints a rich table, or the plan as JSON with `--json`; exits 2 on bad input with
one line naming the option or config key and the fix.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from deepfleet.engine.planner.estimate import GIB, Plan


def _kwargs(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--model-arg: expected KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def add_common_options(ap: argparse.ArgumentParser, *, world_size_help: str) -> None:
    """The options `deepfleet plan` and `deepfleet tune` share: config, model factory, ranks, budget."""
    ap.add_argument("config", help="DeepSpeed-style engine config: a .json/.yaml path or a JSON string")
    ap.add_argument("--model", required=True, help="model factory, 'package.module:function'")
    ap.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="keyword argument for the factory (VALUE is JSON or text); repeatable")
    ap.add_argument("--world-size", type=int, default=1, help=world_size_help)
    ap.add_argument("--budget-gib", type=float, default=None, help="per-rank memory budget (GiB)")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="deepfleet plan", description=__doc__.splitlines()[0])
    add_common_options(ap, world_size_help="data-parallel ranks")
    ap.add_argument("--micro-batch", type=int, default=None, help="default: train_micro_batch_size_per_gpu")
    ap.add_argument("--probe-device", choices=["cpu", "meta"], default="cpu",
                    help="where the activation probe runs (meta: nothing allocated, slightly less exact)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    return ap


def render(plan: Plan) -> None:
    from rich.console import Console
    from rich.table import Table

    p = plan.profile
    title = (f"{p.num_params:,} parameters, {len(p.blocks)} blocks, micro-batch {plan.micro_batch}, "
             f"world size {plan.world_size}" + (f", budget {plan.budget_bytes / GIB:.2f} GiB"
                                                 if plan.budget_bytes else ""))
    table = Table(title=title)
    for col in ("stage", "offload opt/param", "ckpt", "params", "grads", "optim", "master", "buckets",
                "activ.", "activ. no ckpt", "total MiB", "cpu MiB", "nvme MiB", "recompute", "comm", "fits"):
        table.add_column(col, justify="right")
    mib = 1024**2
    for e in plan.estimates:
        c = e.choice
        table.add_row(
            str(c.stage), f"{c.offload_optimizer}/{c.offload_param}", str(len(c.checkpoint)),
            *(f"{v / mib:.1f}" for v in (e.params, e.grads, e.optimizer, e.master, e.buckets, e.activations,
                                        e.activations_without_checkpointing, e.total,
                                        e.offloaded.get("cpu", 0.0), e.offloaded.get("nvme", 0.0))),
            f"{e.recompute:.2f}x", f"{e.comm_volume:.0f}x", "yes" if e.fits(plan.budget_bytes) else "no",
        )
    Console(width=200).print(table)


def one_line_errors(call: Callable[[], Any]) -> Any:
    """`call()`, or None after printing its bad-input error (a config's lines, or one line) to stderr."""
    from deepfleet.engine.config import ConfigError

    try:
        return call()
    except ConfigError as e:
        for line in e.errors:
            print(line, file=sys.stderr)
    except ValueError as e:
        print(str(e), file=sys.stderr)
    return None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from deepfleet.engine.planner.estimate import plan

    result = one_line_errors(lambda: plan(
        args.config, args.model, world_size=args.world_size, budget_gib=args.budget_gib,
        micro_batch=args.micro_batch, factory_kwargs=_kwargs(args.model_arg), probe_device=args.probe_device))
    if result is None:
        return 2
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        render(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
