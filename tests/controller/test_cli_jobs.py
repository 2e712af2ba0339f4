"""The job commands of the `deepfleet` CLI against a real controller process (SQLite, local backend,
fake worker): submit --follow, ls, get, events, logs, cancel, token create; input errors as one-line
field paths with exit 2; where the URL and token come from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from deepfleet.controller.cli import app
from deepfleet.controller.cli_jobs import resolve
from tests.controller.conftest import ADMIN_TOKEN
from tests.controller.e2e_helpers import Controller
from tests.controller.jobspecs import FAKE_WORKER, job_document

runner = CliRunner()


def write_job(tmp_path: Path, name: str, args: list[str], **changes) -> Path:
    doc = job_document(name, args=args)
    doc["metadata"]["project"] = "test"
    doc["spec"].update(changes)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.e2e
def test_job_commands_against_a_real_controller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = Controller(f"sqlite:///{tmp_path / 'db.sqlite'}", tmp_path / "data", worker_command=FAKE_WORKER)
    monkeypatch.setenv("DEEPFLEET_URL", c.url)
    monkeypatch.setenv("DEEPFLEET_API_TOKEN", ADMIN_TOKEN)
    try:
        result = runner.invoke(app, ["submit", str(write_job(tmp_path, "cli-ok", ["--steps", "4"])), "--follow"])
        assert result.exit_code == 0, result.output
        assert "submitted cli-ok as" in result.output and "cli-ok SUCCEEDED" in result.output
        assert "done" in result.output  # the log tail after the progress bar
        job_id = result.output.split("submitted cli-ok as ")[1].split()[0]

        listing = runner.invoke(app, ["ls"])
        assert listing.exit_code == 0 and job_id in listing.output and "SUCCEEDED" in listing.output
        got = runner.invoke(app, ["get", job_id])
        assert got.exit_code == 0 and '"phase": "SUCCEEDED"' in got.output
        goodput = json.loads(got.output)["goodput"]
        assert 0 <= goodput["goodput"] <= 1 and set(goodput["lost_s"]) >= {"queueing", "restarts", "recomputation"}
        top = runner.invoke(app, ["top", "--all"])
        assert top.exit_code == 0 and job_id in top.output and "GOODPUT" in top.output
        assert job_id not in runner.invoke(app, ["top"]).output  # finished: only with --all
        events = runner.invoke(app, ["events", job_id])
        assert [line.split()[2] for line in events.output.splitlines()][-1] == "Succeeded"
        logs = runner.invoke(app, ["logs", job_id, "--node", "1", "--tail", "1"])
        assert logs.output == "done\n"
        followed = runner.invoke(app, ["logs", job_id, "-f"])
        assert followed.exit_code == 0 and followed.output.endswith("done\n")

        long = runner.invoke(app, ["submit", str(write_job(tmp_path, "cli-long", ["--steps", "1000"]))])
        long_id = long.output.split("submitted cli-long as ")[1].split()[0]
        cancelled = runner.invoke(app, ["cancel", long_id])
        assert cancelled.exit_code == 0 and "cancel requested" in cancelled.output
        again = runner.invoke(app, ["submit", str(write_job(tmp_path, "cli-fail", ["--steps", "1", "--exit", "64"])),
                                    "-f"])
        assert again.exit_code == 1 and "cli-fail FAILED" in again.output

        token = runner.invoke(app, ["token", "create", "ci", "--role", "viewer"])
        assert token.exit_code == 0 and token.output.startswith("dft_")
        viewer_cancel = runner.invoke(app, ["cancel", job_id, "--token", token.output.strip()])
        assert viewer_cancel.exit_code == 2 and "error:" in viewer_cancel.output
        missing = runner.invoke(app, ["get", "0" * 32])
        assert missing.exit_code == 2 and "not found" in missing.output
    finally:
        c.stop()


def test_invalid_job_file_is_reported_by_field_without_contacting_anyone(tmp_path: Path) -> None:
    bad = write_job(tmp_path, "bad", [], nodes=0, processesPerNod=2)
    result = runner.invoke(app, ["submit", str(bad), "--url", "http://127.0.0.1:9"])
    assert result.exit_code == 2
    assert "spec.nodes" in result.output and "spec.processesPerNod: unknown field" in result.output
    assert "Traceback" not in result.output
    missing = runner.invoke(app, ["submit", str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 2 and "no such file" in missing.output


def test_unreachable_controller_is_one_clear_line(tmp_path: Path) -> None:
    result = runner.invoke(app, ["ls", "--url", "http://127.0.0.1:9", "--token", "x"])
    assert result.exit_code == 1 and "cannot reach the controller at http://127.0.0.1:9" in result.output
    assert "Traceback" not in result.output


def test_url_and_token_resolution_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.setenv("DEEPFLEET_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("DEEPFLEET_URL", raising=False)
    monkeypatch.delenv("DEEPFLEET_API_TOKEN", raising=False)
    assert resolve(None, None) == ("http://127.0.0.1:8000", None)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "admin-token").write_text("dft_minted\n")
    assert resolve(None, None) == ("http://127.0.0.1:8000", "dft_minted")
    (tmp_path / "cfg" / "deepfleet").mkdir(parents=True)
    (tmp_path / "cfg" / "deepfleet" / "config.yaml").write_text("url: http://cfg:1\ntoken: dft_cfg\n")
    assert resolve(None, None) == ("http://cfg:1", "dft_cfg")
    monkeypatch.setenv("DEEPFLEET_URL", "http://env:2")
    monkeypatch.setenv("DEEPFLEET_API_TOKEN", "dft_env")
    assert resolve(None, None) == ("http://env:2", "dft_env")
    assert resolve("http://flag:3", "dft_flag") == ("http://flag:3", "dft_flag")
    (tmp_path / "cfg" / "deepfleet" / "config.yaml").write_text("url: http://cfg:1\ntokn: typo\n")
    result = runner.invoke(app, ["ls"])
    assert result.exit_code == 2 and "expected a mapping with keys url and token only" in result.output


def test_server_help_lists_its_options() -> None:
    result = runner.invoke(app, ["server", "--help"])
    assert result.exit_code == 0 and "--db" in result.output and "--slots" in result.output


def test_an_engine_file_is_inlined_with_the_engines_own_reader(tmp_path: Path) -> None:
    from deepfleet.controller.cli_jobs import load_job_document
    from deepfleet.controller.spec import validate_job
    from deepfleet.engine.config import load_config

    (tmp_path / "ds.yaml").write_text("train_micro_batch_size_per_gpu: 1\n"
                                      "zero_optimization: {stage: 2, reduce_bucket_size: 5e8}\n")
    sent = json.loads(load_job_document(write_job(tmp_path, "inline", [], engine="ds.yaml")))
    # the number YAML 1.1 would have read as the string "5e8", read as the engine reads it ...
    assert sent["spec"]["engine"]["zero_optimization"]["reduce_bucket_size"] == 5e8
    # ... so what the CLI accepted is what the server accepts, and means the same
    engine = validate_job(sent).spec.engine
    assert load_config(engine, world_size=2) == load_config(tmp_path / "ds.yaml", world_size=2)
