"""Rotating DEEPFLEET_SECRET (PostgreSQL): with the previous secret in DEEPFLEET_OLD_SECRETS, job tokens
made under it still verify and stored secrets still decrypt; `deepfleet db rotate-keys` (the real CLI
process) re-encrypts every stored value under the new secret, after which the old one may go."""

from __future__ import annotations

import os
import subprocess
import sys

from sqlalchemy import select

from deepfleet.controller.db import secrets as secret_store
from deepfleet.controller.db.models import StoredSecret
from deepfleet.controller.db.session import make_engine, make_session_factory
from deepfleet.controller.settings import Settings
from deepfleet.controller.tokens import job_token, verify_job_token

OLD, NEW = "old-secret-" + "a" * 20, "new-secret-" + "b" * 20


def test_job_tokens_made_under_an_old_secret_verify_while_it_is_listed() -> None:
    token = job_token(OLD, "job1")
    assert not verify_job_token(NEW, "job1", token)
    assert verify_job_token(NEW, "job1", token, old_secrets=(OLD,))
    assert not verify_job_token(NEW, "job2", token, old_secrets=(OLD,))  # still bound to its job
    assert verify_job_token(NEW, "job1", job_token(NEW, "job1"), old_secrets=(OLD,))
    settings = Settings.from_env({"DEEPFLEET_SECRET": NEW, "DEEPFLEET_OLD_SECRETS": f"{OLD}, ,x"}, data_dir="/tmp")
    assert settings.old_secret_values() == (OLD, "x")


def _rotate(db_url: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deepfleet.controller.cli", "db", "rotate-keys",
                           "--database-url", db_url], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_rotate_keys_re_encrypts_every_stored_secret_under_the_new_secret(db_url: str) -> None:
    engine = make_engine(db_url, pool_size=1, max_overflow=0)
    sessions = make_session_factory(engine)
    try:
        with sessions() as s:
            for project, name in [("alpha", "wandb"), ("beta", "hf")]:
                secret_store.put(s, project=project, name=name, value=f"{project}-value", key_material=OLD,
                                 actor="t")
            s.commit()
        with sessions() as s:  # before: the new key alone cannot read them, with the old one listed it can
            try:
                secret_store.read(s, project="alpha", name="wandb", key_material=NEW)
                raise AssertionError("read under the wrong key")
            except secret_store.SecretUnavailable as e:
                assert "DEEPFLEET_OLD_SECRETS" in str(e)
            assert secret_store.read(s, project="alpha", name="wandb", key_material=NEW, old=(OLD,)) == "alpha-value"
            before = {r.name: r.ciphertext for r in s.scalars(select(StoredSecret))}

        missing = _rotate(db_url, {"DEEPFLEET_SECRET": NEW, "DEEPFLEET_OLD_SECRETS": ""})
        assert missing.returncode == 1 and "no key given decrypts it" in missing.stderr
        done = _rotate(db_url, {"DEEPFLEET_SECRET": NEW, "DEEPFLEET_OLD_SECRETS": OLD})
        assert done.returncode == 0, done.stderr
        assert "re-encrypted 2 stored secret(s)" in done.stdout
        assert OLD not in done.stdout + done.stderr and NEW not in done.stdout + done.stderr

        with sessions() as s:  # after: readable under the new key alone, and no longer under the old one
            assert secret_store.read(s, project="alpha", name="wandb", key_material=NEW) == "alpha-value"
            assert secret_store.read(s, project="beta", name="hf", key_material=NEW) == "beta-value"
            after = {r.name: r.ciphertext for r in s.scalars(select(StoredSecret))}
            assert all(after[n] != before[n] for n in before)
            try:
                secret_store.read(s, project="beta", name="hf", key_material=OLD)
                raise AssertionError("still readable under the old key")
            except secret_store.SecretUnavailable:
                pass
        unset = _rotate(db_url, {"DEEPFLEET_SECRET": ""})
        assert unset.returncode == 2 and "DEEPFLEET_SECRET" in unset.stderr
    finally:
        engine.dispose()
