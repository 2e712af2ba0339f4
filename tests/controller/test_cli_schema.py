"""`deepfleet schema` prints the published JobSpec JSON schema (the one the snapshot freezes)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from deepfleet.controller.cli import app
from deepfleet.controller.spec import JobSpec


def test_schema_command_prints_the_jobspec_schema() -> None:
    result = CliRunner().invoke(app, ["schema"])
    assert result.exit_code == 0, result.output
    schema = json.loads(result.output)
    assert schema == JobSpec.model_json_schema()
    assert schema["title"] == "TrainingJob" and "spec" in schema["required"]
