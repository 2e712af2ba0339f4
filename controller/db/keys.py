"""`deepfleet db rotate-keys`: re-encrypt the secret store under the current `DEEPFLEET_SECRET`.

Run as its own module by the CLI (which never imports the database layer) with the controller's
settings in the environment: `DEEPFLEET_SECRET` (the new secret), `DEEPFLEET_OLD_SECRETS` (the ones
values may still be stored under) and the database URL. Exits 0 when every value was rewritten, 1 when
some could not be decrypted (one line each; the others are rewritten), 2 for bad settings.
"""

from __future__ import annotations

import argparse
import os
import sys

from deepfleet.controller.db import secrets as secret_store
from deepfleet.controller.db.session import make_engine, make_session_factory
from deepfleet.controller.settings import Settings, SettingsError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deepfleet db rotate-keys", description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", help="Default: DEEPFLEET_DATABASE_URL / DATABASE_URL.")
    args = parser.parse_args(argv)
    try:
        settings = Settings.from_env(database_url=args.database_url)
    except SettingsError as e:
        for line in e.errors:
            print(f"deepfleet db rotate-keys: {line}", file=sys.stderr)
        return 2
    if not os.environ.get("DEEPFLEET_SECRET"):
        print("deepfleet db rotate-keys: DEEPFLEET_SECRET: not set; set it to the controller's (new) secret",
              file=sys.stderr)
        return 2
    engine = make_engine(settings.db_url, pool_size=1, max_overflow=0)
    try:
        with make_session_factory(engine)() as session:
            rotated, unreadable = secret_store.rotate(session, key_material=settings.secret.get_secret_value(),
                                                      old=settings.old_secret_values())
            session.commit()
    finally:
        engine.dispose()
    for line in unreadable:
        print(f"deepfleet db rotate-keys: {line}", file=sys.stderr)
    print(f"re-encrypted {rotated} stored secret(s) under the current DEEPFLEET_SECRET")
    return 1 if unreadable else 0


if __name__ == "__main__":
    sys.exit(main())
