"""`python -m deepfleet.engine.checkpoint.cli inspect DIR` and `... export DIR --out FILE [--dtype bf16]`.

The torch-side checkpoint command line. The main `deepfleet` CLI (controller/cli.py) must stay
torch-free, so its `deepfleet checkpoint ...` command runs this module as a subprocess. DIR is either
a checkpoint root (holding step directories and `latest`) or one step directory. User errors (no such
directory, no complete checkpoint, a damaged one) print one line and exit 2; nothing prints a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from deepfleet.engine.checkpoint import layout
from deepfleet.engine.checkpoint.layout import CheckpointError

EXIT_INVALID_INPUT = 2

app = typer.Typer(
    name="checkpoint",
    help="Inspect deepfleet checkpoints and export their weights to safetensors.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(EXIT_INVALID_INPUT)


def resolve_step_dir(path: Path) -> Path:
    """A step directory for `path`: itself when it is one, else the newest complete step under it."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such directory")
    if (path / layout.MANIFEST).exists() or (path / ".metadata").exists() or (path / layout.COMPLETE).exists():
        return path
    tag = layout.find_latest_complete(path)
    if tag is None:
        raise CheckpointError(f"{path}: holds no complete checkpoint")
    return path / tag


@app.command()
def inspect(
    directory: Annotated[Path, typer.Argument(help="A checkpoint root or one step directory.")],
    verify: Annotated[bool, typer.Option("--verify", help="Also check every file's size and sha256.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")] = False,
) -> None:
    """Show the steps under a root (complete or not), or one step's manifest and tensors."""
    from deepfleet.engine.checkpoint.io import StepReader

    try:
        if not directory.is_dir():
            raise CheckpointError(f"{directory}: no such directory")
        steps = layout.list_steps(directory)
        if steps:  # a root; a step directory holds files only
            report = {
                "root": str(directory),
                "latest": layout.read_latest(directory),
                "latest_complete": layout.find_latest_complete(directory),
                "steps": [
                    {"tag": s.tag, "complete": s.complete, "global_steps": s.global_steps} for s in steps
                ],
            }
        else:
            reader = StepReader(resolve_step_dir(directory))
            if verify:
                reader.verify()
            shapes = reader.saved_shapes()
            m = reader.manifest
            report = {
                "step_dir": str(reader.step_dir),
                **m.model_dump(exclude={"files"}),
                "files": len(m.files),
                "bytes": m.total_bytes,
                "verified": verify,
                "model_tensors": {
                    k.removeprefix("model."): [list(shape), str(dt).removeprefix("torch.")]
                    for k, (shape, dt) in sorted(shapes.items())
                    if k.startswith("model.")
                },
                "optimizer_tensors": sum(1 for k in shapes if k.startswith("optim.")),
            }
    except CheckpointError as e:
        raise _fail(str(e)) from None
    if as_json:
        typer.echo(json.dumps(report))
        return
    for key, value in report.items():
        if key == "steps":
            typer.echo("steps:")
            for s in value:
                mark = "complete" if s["complete"] else "INCOMPLETE (never loaded)"
                typer.echo(f"  {s['tag']:<24} {mark}  global_steps={s['global_steps']}")
        elif key == "model_tensors":
            typer.echo(f"model_tensors: {len(value)}")
            for name, (shape, dt) in value.items():
                typer.echo(f"  {name:<40} {dt:<9} {shape}")
        else:
            typer.echo(f"{key}: {value}")


@app.command()
def export(
    directory: Annotated[Path, typer.Argument(help="A checkpoint root (uses the newest complete step) or a step.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="The safetensors file to write.")],
    dtype: Annotated[str, typer.Option("--dtype", help="fp32, bf16 or fp16 for floating-point tensors.")] = "fp32",
    budget_mb: Annotated[int, typer.Option("--budget-mb", min=1, help="Most tensor MiB held at once.")] = 256,
    provenance: Annotated[Path | None, typer.Option(
        "--provenance", help="The job's provenance (`deepfleet provenance JOB --json` output) to embed.")] = None,
) -> None:
    """Write the model weights as one consolidated safetensors file, streaming tensor by tensor."""
    from deepfleet.engine.checkpoint.export import export_safetensors
    from deepfleet.engine.provenance import model_metadata

    try:
        metadata = model_metadata(json.loads(provenance.read_text())) if provenance is not None else None
    except (OSError, ValueError) as e:
        raise _fail(f"--provenance: {e}; give the JSON file `deepfleet provenance JOB --json` writes") from None
    try:
        report = export_safetensors(resolve_step_dir(directory), out, dtype=dtype, budget_bytes=budget_mb << 20,
                                    metadata=metadata)
    except CheckpointError as e:
        raise _fail(str(e)) from None
    typer.echo(json.dumps({"out": str(report.path), "tensors": report.tensors, "bytes": report.bytes}))


def main() -> None:
    """Console entry point."""
    app()


if __name__ == "__main__":
    main()
