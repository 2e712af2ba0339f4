"""The controller's secret store: values that `env` entries of local-backend jobs reference by name.

Used by the /v1/secrets API (set, list names, delete; `controller.api.secrets`) and by the server's
local backend, which resolves a job's references when it starts the job's processes
(`resolver`). Values are encrypted with Fernet (AES-128-CBC + HMAC-SHA256, from `cryptography`)
under a key derived (HKDF-SHA256) from the controller's `DEEPFLEET_SECRET`, so a database dump or
backup alone reveals nothing. To change that secret, list the previous one in `DEEPFLEET_OLD_SECRETS`
(values then decrypt under either) and run `deepfleet db rotate-keys` (`rotate`), which re-encrypts
every value under the new one; a value whose key is in neither is unreadable (set it again).
Nothing here logs or returns a value except `read`, whose only caller hands it to the job's process.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Sequence

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deepfleet.controller.db.models import Project, StoredSecret, utcnow

__all__ = ["StoredSecret", "SecretUnavailable"]

MAX_VALUE_BYTES = 64 * 1024


class SecretUnavailable(LookupError):
    """A referenced secret is missing or cannot be decrypted (the message names it and the fix)."""


def _box(key_material: str) -> Fernet:
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"deepfleet secret store v1").derive(
        key_material.encode())
    return Fernet(base64.urlsafe_b64encode(key))


def _boxes(key_material: str, old: Sequence[str]) -> MultiFernet:
    """Encrypts under `key_material`; decrypts under it or any of `old`."""
    return MultiFernet([_box(key_material), *(_box(k) for k in old)])


def rotate(session: Session, *, key_material: str, old: Sequence[str]) -> tuple[int, list[str]]:
    """Re-encrypt every stored value (all projects) under `key_material`: (how many were rewritten, one line
    per value none of the keys decrypts). The caller commits."""
    boxes, rotated, unreadable = _boxes(key_material, old), 0, []
    for row in session.scalars(select(StoredSecret).order_by(StoredSecret.project, StoredSecret.name)):
        try:
            row.ciphertext = boxes.rotate(row.ciphertext.encode()).decode()
        except InvalidToken:
            unreadable.append(f"secret {row.name!r} of project {row.project!r}: no key given decrypts it; set it "
                              "again, or add the key it was stored under to DEEPFLEET_OLD_SECRETS")
            continue
        rotated += 1
    return rotated, unreadable


def put(session: Session, *, project: str, name: str, value: str, key_material: str, actor: str) -> bool:
    """Create or replace a secret; True when it was created. The caller commits."""
    if session.get(Project, project) is None:
        session.add(Project(name=project))
    token = _box(key_material).encrypt(value.encode()).decode()
    row = session.get(StoredSecret, (project, name))
    if row is None:
        session.add(StoredSecret(project=project, name=name, ciphertext=token, updated_by=actor))
        return True
    row.ciphertext, row.updated_at, row.updated_by = token, utcnow(), actor
    return False


def names(session: Session, *, project: str) -> list[StoredSecret]:
    """The project's secrets (rows; callers show names and times only)."""
    return list(session.scalars(select(StoredSecret).where(StoredSecret.project == project)
                                .order_by(StoredSecret.name)))


def exists(session: Session, *, project: str, name: str) -> bool:
    return session.get(StoredSecret, (project, name)) is not None


def delete(session: Session, *, project: str, name: str) -> bool:
    """Remove a secret; False when there was none. The caller commits."""
    row = session.get(StoredSecret, (project, name))
    if row is None:
        return False
    session.delete(row)
    return True


def read(session: Session, *, project: str, name: str, key_material: str, old: Sequence[str] = ()) -> str:
    """The plain value. Raises SecretUnavailable."""
    row = session.get(StoredSecret, (project, name))
    if row is None:
        raise SecretUnavailable(f"secret {name!r} is not in project {project!r}'s secret store; set it with "
                                f"`deepfleet secret set {name}`")
    try:
        return _boxes(key_material, old).decrypt(row.ciphertext.encode()).decode()
    except InvalidToken:
        raise SecretUnavailable(f"secret {name!r} of project {project!r} cannot be decrypted (DEEPFLEET_SECRET "
                                f"changed since it was set); set it again, or list the earlier secret in "
                                f"DEEPFLEET_OLD_SECRETS") from None


def resolver(sessions: sessionmaker[Session], *, key_material: str,
             old: Sequence[str] = ()) -> Callable[[str, str], str]:
    """`(project, name) -> value` for the local backend; raises SecretUnavailable."""

    def resolve(project: str, name: str) -> str:
        with sessions() as s:
            return read(s, project=project, name=name, key_material=key_material, old=old)

    return resolve
