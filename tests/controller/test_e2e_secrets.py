"""A secret set with `deepfleet secret set` (value from standard input or a file, listed by name only,
deleted with `deepfleet secret rm`) reaches a local job's training process (checked from inside the
job, through the real `deepfleet-worker`) and nothing else: not the API's answers, events, logs,
/metrics or error bodies, not the WorkerSpec, not any file the controller writes (PostgreSQL).
Slow: a real controller process and a real worker (about 25 s on two cores)."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from deepfleet.controller.cli import app
from deepfleet.controller.client import ApiError
from tests.controller.conftest import ADMIN_TOKEN
from tests.controller.e2e_helpers import Controller, wait_phase

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
VALUE = "s3cr3t-wandb-9f8e7d6c5b4a"
DUMP = textwrap.dedent("""
    import json, os, pathlib
    pathlib.Path("env-seen.json").write_text(json.dumps(dict(os.environ)))
    print("dumped", len(os.environ), "variables")
""")


def _job(name: str, secret: str) -> str:
    return yaml.safe_dump({"apiVersion": "deepfleet/v1", "kind": "TrainingJob",
                           "metadata": {"name": name, "project": "test"},
                           "spec": {"backend": "local", "nodes": 1, "entrypoint": {"script": "dump_env.py"},
                                    "env": {"WANDB_API_KEY": {"secret": secret}, "TEAM": "nlp"},
                                    "restartPolicy": {"maxRestarts": 0}}})


def test_a_stored_secret_reaches_the_training_process_and_nothing_else(db_url: str, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    data, code = tmp_path / "data", tmp_path / "code"
    code.mkdir()
    (code / "dump_env.py").write_text(DUMP)
    c = Controller(db_url, data, workdir=code, replica="sec")
    monkeypatch.setenv("DEEPFLEET_URL", c.url)
    monkeypatch.setenv("DEEPFLEET_API_TOKEN", ADMIN_TOKEN)
    cli = CliRunner()
    try:
        (tmp_path / "gone.txt").write_text(VALUE + "-gone\n")
        for argv, stdin in ((["secret", "set", "wandb"], VALUE + "\n"),
                            (["secret", "set", "gone", "--from-file", str(tmp_path / "gone.txt")], None)):
            result = cli.invoke(app, argv, input=stdin)
            assert result.exit_code == 0 and VALUE not in result.output, result.output
        listed = cli.invoke(app, ["secret", "ls"])
        assert [line.split()[0] for line in listed.output.splitlines()] == ["gone", "wandb"]
        assert VALUE not in listed.output
        job = c.client.submit(_job("uses-secret", "wandb"))["id"]
        final = wait_phase(c.client, job, {"SUCCEEDED", "FAILED"}, timeout=120)
        assert final["phase"] == "SUCCEEDED", c.client.events(job)
        seen = json.loads((data / "jobs" / "test" / job / "work" / "env-seen.json").read_text())
        assert seen["WANDB_API_KEY"] == VALUE and seen["TEAM"] == "nlp"
        assert VALUE not in seen["DEEPFLEET_WORKER_SPEC"]

        assert cli.invoke(app, ["secret", "rm", "gone"]).output == "secret gone deleted\n"
        assert cli.invoke(app, ["secret", "rm", "gone"]).exit_code == 2  # 404: one line, exit 2
        with pytest.raises(ApiError) as refused:  # a deleted secret is refused at submit, with a 422
            c.client.submit(_job("again", "gone"))
        assert refused.value.status == 422

        answers = [c.client.get(job), c.client.events(job), c.client.list_jobs(), c.client.logs(job),
                   c.client.list_secrets(), str(refused.value), httpx.get(c.url + "/metrics").text,
                   httpx.put(c.url + "/v1/secrets/wandb", json={"value": VALUE}).text,  # no token: 401
                   httpx.put(c.url + "/v1/secrets/wandb", json={"value": VALUE, "x": 1},
                             headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).text]
        blob = json.dumps(answers, default=str)
        assert VALUE not in blob and "-gone" not in blob
    finally:
        c.stop()
    job_file = data / "jobs" / "test" / job / "work" / "env-seen.json"
    for root, _, files in os.walk(data):  # logs, state files, the controller's log: the job's own dump only
        for name in files:
            path = Path(root) / name
            if path != job_file:
                assert VALUE.encode() not in path.read_bytes(), path
