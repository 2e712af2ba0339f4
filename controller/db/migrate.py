"""Run the Alembic migrations from code: `upgrade_head(url)` at server start, the Helm hook and tests.

The scripts live in the top-level `migrations/` folder, shipped in the wheel as the
`deepfleet.migrations` package, so an installed controller image can migrate without the
source tree. The `alembic` command in a checkout reads the same folder through `[tool.alembic]`
in pyproject.toml.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from alembic import command
from alembic.config import Config

from deepfleet.controller.db.session import make_engine


def migrations_dir() -> Path:
    """The folder holding env.py and versions/ (from the installed `deepfleet.migrations` package)."""
    spec = importlib.util.find_spec("deepfleet.migrations")
    if spec is None or spec.origin is None:
        raise RuntimeError("deepfleet.migrations is not installed; reinstall deepfleet with the controller extra")
    return Path(spec.origin).parent


def alembic_config(url: str) -> Config:
    """An Alembic Config pointing at our scripts and `url` (no .ini file needed)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    # ConfigParser interpolates '%', which URL-encoded passwords contain.
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade_head(url: str) -> None:
    """Bring the database at `url` to the newest schema (a no-op when it is already there)."""
    _run(url, "upgrade", "head")


def downgrade_base(url: str) -> None:
    """Drop every table the migrations created (tests and disaster recovery only)."""
    _run(url, "downgrade", "base")


def _run(url: str, action: str, target: str) -> None:
    cfg = alembic_config(url)
    engine = make_engine(url)
    try:
        with engine.begin() as connection:
            cfg.attributes["connection"] = connection
            getattr(command, action)(cfg, target)
    finally:
        engine.dispose()


def main(argv: list[str] | None = None) -> int:
    """`python -m deepfleet.controller.db.migrate {upgrade,downgrade,current}` (what `deepfleet db` runs).

    The database comes from --database-url, else the controller settings (DEEPFLEET_DATABASE_URL,
    DATABASE_URL, or the embedded SQLite default).
    """
    import argparse
    import sys

    from deepfleet.controller.settings import Settings, SettingsError

    parser = argparse.ArgumentParser(prog="deepfleet db", description="Migrate the controller database.")
    parser.add_argument("action", choices=["upgrade", "downgrade", "current"])
    parser.add_argument("revision", nargs="?", help="Target revision (default: head for upgrade, base for downgrade).")
    parser.add_argument("--database-url", help="SQLAlchemy URL; default from DEEPFLEET_DATABASE_URL / DATABASE_URL.")
    args = parser.parse_args(argv)
    try:
        url = args.database_url or Settings.from_env().db_url
    except SettingsError as e:
        print("\n".join(e.errors), file=sys.stderr)
        return 2
    if args.action == "current":
        cfg = alembic_config(url)
        engine = make_engine(url)
        try:
            with engine.connect() as connection:
                cfg.attributes["connection"] = connection
                command.current(cfg)
        finally:
            engine.dispose()
        return 0
    target = args.revision or ("head" if args.action == "upgrade" else "base")
    _run(url, args.action, target)
    print(f"database {args.action}d to {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
