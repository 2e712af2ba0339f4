"""docs/jobspec.md is generated from the JobSpec model: regenerating it must give the committed page,
and the page must name every field the schema has."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from deepfleet.controller.cli import app
from deepfleet.controller.spec import JobSpec
from deepfleet.controller.spec_reference import render_reference

PAGE = Path(__file__).resolve().parents[2] / "docs" / "jobspec.md"


def test_the_committed_reference_is_what_the_model_generates() -> None:
    result = CliRunner().invoke(app, ["schema", "--markdown"])
    assert result.exit_code == 0, result.output
    assert result.output == render_reference()
    assert PAGE.read_text() == result.output, (
        "docs/jobspec.md is stale; regenerate it: deepfleet schema --markdown > docs/jobspec.md")


def test_every_field_has_a_row_with_a_description() -> None:
    schema = JobSpec.model_json_schema()
    page = render_reference()
    for model in [schema, *schema["$defs"].values()]:
        for name in model.get("properties", {}):
            rows = [line for line in page.splitlines() if line.startswith("| `") and f".{name}` |" in line
                    or line.startswith(f"| `{name}` |")]
            assert rows, f"{model.get('title')}.{name} has no row"
            assert all(not row.endswith("|  |") for row in rows), rows
