"""Helpers for the API tests: tokens of any project/role straight in the database, a valid job document."""

from __future__ import annotations

import textwrap
from datetime import datetime

from fastapi import FastAPI

from deepfleet.controller.db.auth import create_api_token

JOB_YAML = textwrap.dedent(
    """
    apiVersion: deepfleet/v1
    kind: TrainingJob
    metadata: {name: NAME, project: PROJECT, labels: {team: nlp}}
    spec:
      backend: local
      nodes: 2
      processesPerNode: 1
      entrypoint: {script: examples/gpt/train.py, args: ["--steps", "50"]}
    """
)


def job_yaml(name: str = "gpt-small", project: str = "research", **replace: str) -> str:
    text = JOB_YAML.replace("NAME", name).replace("PROJECT", project)
    for old, new in replace.items():
        text = text.replace(old, new)
    return text


def token(app: FastAPI, *, project: str, role: str, expires_at: datetime | None = None) -> dict[str, str]:
    """Authorization headers for a fresh token of `project` with `role`."""
    with app.state.sessions() as session:
        _, text = create_api_token(session, project=project, role=role, name=f"{role}-test",
                                   expires_at=expires_at, created_by="test")
        session.commit()
    return {"Authorization": f"Bearer {text}"}


def yaml_headers(auth: dict[str, str]) -> dict[str, str]:
    return {**auth, "Content-Type": "application/yaml"}
