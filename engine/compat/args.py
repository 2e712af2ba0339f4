"""`deepspeed.add_config_arguments(parser)` and how `initialize(args=...)` reads what it adds.

DeepSpeed adds a "DeepSpeed" argument group with `--deepspeed` (a flag scripts test to enable the
engine), `--deepspeed_config` (the config file) and the deprecated `--deepscale`/`--deepscale_config`;
launchers also pass `--local_rank`, which scripts declare themselves. `config_from_args` is what
`initialize` uses: `args.deepspeed_config`, else `args.deepscale_config`; giving a config both in `args`
and as `config=` is an error, as in DeepSpeed.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's launcher/config arguments to `parser` and return it."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable the engine (scripts test this flag)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed-style JSON/YAML config file")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def config_from_args(args: Any, given: Any) -> Any:
    """The config source `initialize` uses: `given` (config= / config_params=) or the one in `args`.
    Raises ValueError when both name one."""
    from_args = None
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if given is not None and from_args is not None:
        raise ValueError(
            "config: given both as initialize(config=...) and as args.deepspeed_config; pass only one of them"
        )
    return given if given is not None else from_args
