"""Controller settings from DEEPFLEET_* variables and flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepfleet.controller.settings import Settings, SettingsError


def test_defaults_and_env(tmp_path: Path) -> None:
    s = Settings.from_env({"HOME": str(tmp_path)})
    assert s.db_url == f"sqlite:///{tmp_path}/.local/share/deepfleet/deepfleet.db"
    assert s.logs_root == tmp_path / ".local/share/deepfleet/logs"
    assert s.backends == ["local"] and s.max_request_bytes == 1_048_576
    env = {"HOME": str(tmp_path), "DEEPFLEET_DATABASE_URL": "postgresql+psycopg://u@db/df",
           "DEEPFLEET_BACKENDS": "kubernetes,local", "DEEPFLEET_MAX_REQUEST_BYTES": "4096",
           "DEEPFLEET_TOKEN_TTL_DAYS": "7"}
    s = Settings.from_env(env)
    assert (s.db_url, s.backends, s.max_request_bytes, s.token_ttl_days) == (
        "postgresql+psycopg://u@db/df", ["kubernetes", "local"], 4096, 7.0)
    assert Settings.from_env(env, max_request_bytes=8192).max_request_bytes == 8192  # flags win
    assert Settings.from_env({"HOME": str(tmp_path), "DATABASE_URL": "sqlite:///x.db"}).db_url == "sqlite:///x.db"


def test_bad_values_name_the_variable(tmp_path: Path) -> None:
    with pytest.raises(SettingsError) as info:
        Settings.from_env({"HOME": str(tmp_path), "DEEPFLEET_BACKENDS": "slurm", "DEEPFLEET_MAX_REQUEST_BYTES": "big"})
    assert [e.split(":")[0] for e in info.value.errors] == ["DEEPFLEET_BACKENDS", "DEEPFLEET_MAX_REQUEST_BYTES"]


def test_the_helm_charts_variable_names_are_read(tmp_path) -> None:
    env = {"HOME": str(tmp_path), "DEEPFLEET_DB_URL": "postgresql+psycopg://u@db/df", "DEEPFLEET_BACKEND": "kubernetes",
           "DEEPFLEET_RECONCILE_INTERVAL": "5", "DEEPFLEET_PUBLIC_URL": "http://deepfleet.ns.svc:8000"}
    s = Settings.from_env(env)
    assert (s.database_url, s.backends, s.reconcile_interval_s, s.controller_url) == \
        ("postgresql+psycopg://u@db/df", ["kubernetes"], 5.0, "http://deepfleet.ns.svc:8000")
    # The field's own variable wins over the chart's alias.
    assert Settings.from_env({**env, "DEEPFLEET_BACKENDS": "local"}).backends == ["local"]
