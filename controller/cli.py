"""The `deepfleet` command line: a thin typer root.

Called by the `deepfleet` console script (`main`). Each command imports what it needs inside its
function body, so `deepfleet --help` stays fast and the CLI never pulls torch, the API, the
database or a backend into its process (import-linter checks the last three).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from deepfleet.controller.cli_jobs import register as register_job_commands

app = typer.Typer(
    name="deepfleet",
    help="Train large PyTorch models across many machines, and run those jobs locally, on Kubernetes or Azure ML.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Exit code for input the user must fix (same meaning as the worker's "invalid spec or config").
EXIT_INVALID_INPUT = 2


@app.callback()
def _root() -> None:
    """deepfleet: train large PyTorch models and run those jobs on local machines, Kubernetes or Azure ML."""
    # A callback keeps `deepfleet <command>` a command group even while only one command exists.


@app.command()
def validate(
    config: Annotated[str, typer.Argument(help="DeepSpeed-style engine config: a .json/.yaml path or a JSON string.")],
    world_size: Annotated[
        int, typer.Option("--world-size", "-w", min=1,
                          help="Ranks the job runs on, to resolve batch sizes over the data-parallel ranks that "
                               "the config's degrees (tensor_parallel.autotp_size, sequence_parallel_size, "
                               "pipeline.stages) leave.")
    ] = 1,
    hidden_size: Annotated[
        int | None, typer.Option("--hidden-size", min=1, help="Model hidden size, to resolve \"auto\" ZeRO bucket sizes.")
    ] = None,
    auto: Annotated[
        list[str] | None,
        typer.Option("--auto", metavar="KEY=VALUE",
                     help='Value for an "auto" key, e.g. optimizer.params.lr=3e-5 (VALUE is JSON or text); repeatable.'),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the normalized config as one compact JSON line.")
    ] = False,
) -> None:
    """Check an engine config and print it normalized (every default filled in, "auto" resolved).

    Exits 0 when valid; otherwise prints one line per problem ("<dotted.key>: <problem>; <fix>")
    and exits 2.
    """
    from deepfleet.engine.config import ConfigError, load_config
    from deepfleet.engine.config_parallel import raw_dp_size

    source: str | Path = config
    try:
        dp_size = raw_dp_size(source, world_size=world_size)
        cfg = load_config(source, world_size=world_size, dp_size=dp_size if dp_size != world_size else None,
                          hidden_size=hidden_size, auto_values=_auto_values(auto))
    except ConfigError as e:
        for line in e.errors:
            typer.echo(line, err=True)
        raise typer.Exit(EXIT_INVALID_INPUT) from None
    normalized = cfg.to_dict()
    typer.echo(json.dumps(normalized) if as_json else json.dumps(normalized, indent=2))


@app.command()
def schema(
    markdown: Annotated[bool, typer.Option("--markdown", help="Print the reference page (docs/jobspec.md) instead.")]
    = False,
) -> None:
    """Print the JSON schema of a job document (apiVersion deepfleet/v1, kind TrainingJob)."""
    if markdown:
        from deepfleet.controller.spec_reference import render_reference

        typer.echo(render_reference(), nl=False)
        return
    from deepfleet.controller.spec import JobSpec

    typer.echo(json.dumps(JobSpec.model_json_schema(), indent=2))


db_app = typer.Typer(help="Controller database maintenance.", no_args_is_help=True)
app.add_typer(db_app, name="db")


DatabaseUrl = Annotated[
    str | None, typer.Option("--database-url", help="Default: DEEPFLEET_DATABASE_URL / DATABASE_URL.")
]


def _run_db_module(module: str, *args: str, database_url: str | None) -> None:
    """Run a database-layer module as its own process: the CLI never imports the database layer
    (import contract)."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", module, *args]
    argv += ["--database-url", database_url] if database_url else []
    raise typer.Exit(subprocess.call(argv))


@db_app.command("upgrade")
def db_upgrade(database_url: DatabaseUrl = None) -> None:
    """Migrate the controller database to the newest schema (the Helm chart's pre-install hook)."""
    _run_db_module("deepfleet.controller.db.migrate", "upgrade", database_url=database_url)


@db_app.command("rotate-keys")
def db_rotate_keys(database_url: DatabaseUrl = None) -> None:
    """Re-encrypt every stored secret under DEEPFLEET_SECRET (reading the old ones under DEEPFLEET_OLD_SECRETS)."""
    _run_db_module("deepfleet.controller.db.keys", database_url=database_url)


# Engine command lines, each run as its own process so the CLI stays torch-free (import contract):
# (command, module, one-line help). Their options are the module's own (`deepfleet NAME --help`).
ENGINE_COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("checkpoint", "deepfleet.engine.checkpoint.cli",
     "Inspect checkpoints or export weights to safetensors (`deepfleet checkpoint --help` for more)."),
    ("serve", "deepfleet.engine.inference.serve_cli",
     "Serve a checkpoint at an OpenAI-compatible /v1/completions (`deepfleet serve --help` for more)."),
    ("plan", "deepfleet.engine.planner.cli",
     "Per-rank peak memory and step-time factors of each ZeRO stage, offload and checkpointing choice "
     "(`deepfleet plan --help` for more)."),
    ("tune", "deepfleet.engine.planner.tune_cli",
     "Choose ZeRO stage, micro-batch and offload for the most tokens/s within a memory budget; writes the "
     "winning ds_config (`deepfleet tune --help` for more)."),
    ("run", "deepfleet.engine.compat.run_cli",
     "Run an unmodified DeepSpeed/torchrun script on deepfleet (`deepfleet run --help` for more)."),
)


def _register_engine_command(name: str, module: str, help_text: str) -> None:
    def command(ctx: typer.Context) -> None:
        _run_torch_module(module, ctx.args)

    app.command(
        name,
        help=help_text,
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
        add_help_option=False,
    )(command)


def _run_torch_module(module: str, args: list[str]) -> None:
    """Replace this process by the engine command line (the CLI stays torch-free: import contract). An
    exec, not a child process: signals (a supervisor's SIGTERM) reach the command itself, and no child
    outlives the CLI."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", module, *args])


for _name, _module, _help in ENGINE_COMMANDS:
    _register_engine_command(_name, _module, _help)


register_job_commands(app)  # server, submit, ls, get, logs, cancel, events, token (controller/cli_jobs.py)


def _auto_values(pairs: list[str] | None) -> dict[str, object]:
    """`KEY=VALUE` options -> {dotted key: value}; VALUE is parsed as JSON when it is JSON, else kept as text."""
    values: dict[str, object] = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"expected KEY=VALUE, got {pair!r}", param_hint="--auto")
        try:
            values[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            values[key.strip()] = raw
    return values


def main() -> None:
    """Entry point of the `deepfleet` console script."""
    app()


if __name__ == "__main__":
    main()
