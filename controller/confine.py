"""Where a job may read and write on the controller's host: its job area, its project's code directory,
and the rules for the paths and factory names a spec gives.

Called by the API at submit (`spec_path_errors`, `factory_errors`: static checks, no file is read)
and by `controller.backends.local` when it starts a run (`job_area`, `resolve_inside`: the paths are
resolved on disk, symlinks included). Stdlib only; hand-written because the rule is ours: a path in a
spec is a name *inside* a root the controller chose, never a place on the host.

Layout (all owned by the controller, made here):

    <jobs_dir>/                        0711 (enter, not list)
      <project>/                       0711
        <job id>/                      0700, owned by the user that runs the job
          work/   tmp/                 working directory, HOME, TMPDIR
          checkpoints/                 `checkpoint.dir` resolves here; `resumeFrom` copies in here
          status/                      node exit files

A job id is the area's name, so the same job name submitted again starts from an empty area; only
`checkpoint.resumeFrom` (a job of the same project) carries a checkpoint over.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepfleet.controller.spec import JobSpec

# Top-level packages a factory never names unless the admin allow-lists them: a factory is the user's
# own code, not a way to call into the interpreter or the controller.
_FORBIDDEN_TOP = frozenset(sys.stdlib_module_names) | {"deepfleet", "builtins", "pip", "setuptools", "_pytest",
                                                       "pytest", "sqlalchemy", "fastapi", "uvicorn"}


class ConfineError(ValueError):
    """A path that leaves the root it must stay in (or cannot be made)."""


@dataclass(frozen=True)
class JobArea:
    """One job's own directories (see the module docstring)."""

    project: str
    root: Path

    @property
    def work(self) -> Path:
        return self.root / "work"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def status(self) -> Path:
        return self.root / "status"


def job_area_path(jobs_dir: Path, *, project: str, job_id: str) -> JobArea:
    """The area of `job_id` (not created)."""
    if not project or "/" in project or project.startswith(".") or not job_id or "/" in job_id or job_id.startswith("."):
        raise ConfineError(f"project {project!r} / job id {job_id!r} cannot name a directory")
    return JobArea(project=project, root=Path(jobs_dir) / project / job_id)


def user_ids(user: str | int) -> tuple[int, int]:
    """(uid, gid) of a user name, or of a bare uid ("60001": uid and gid 60001, no passwd entry needed)."""
    if isinstance(user, int) or str(user).isdigit():
        return int(user), int(user)
    import pwd

    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise ConfineError(f"no user {user!r} to run jobs as; create it or give a uid") from None
    return entry.pw_uid, entry.pw_gid


def job_area(jobs_dir: Path, *, project: str, job_id: str, owner: tuple[int, int] | None = None) -> JobArea:
    """Create (idempotently) the area of `job_id`, owned by `owner` (uid, gid; None: ours)."""
    area = job_area_path(jobs_dir, project=project, job_id=job_id)
    for parent in (Path(jobs_dir), area.root.parent):
        parent.mkdir(mode=0o711, parents=True, exist_ok=True)
        os.chmod(parent, 0o711)
    for d in (area.root, area.work, area.tmp, area.checkpoints, area.status):
        d.mkdir(mode=0o700, exist_ok=True)
        if d.is_symlink():
            raise ConfineError(f"{d} is a symlink; the job area must be the controller's own directory")
        if owner is not None:
            os.chown(d, *owner, follow_symlinks=False)
    return area


def closed_ancestor(path: Path) -> Path | None:
    """The first existing directory above `path` that other users cannot enter (mode lacks o+x), or None.
    A job run as another user cannot reach its area below such a directory."""
    for parent in [*reversed(Path(path).absolute().parents), Path(path).absolute()]:
        if parent.is_dir() and not parent.stat().st_mode & 0o001:
            return parent
    return None


def code_dir_for(template: str, *, project: str) -> Path:
    """The project's code directory: `template` with `{project}` replaced (the same for all without it)."""
    return Path(template.replace("{project}", project))


def resolve_inside(root: Path, user_path: str, *, field: str) -> Path:
    """`user_path` resolved (symlinks followed) inside `root`; raises ConfineError naming `field` if it escapes."""
    base = Path(root).resolve()
    target = (base / user_path).resolve()
    if target != base and base not in target.parents:
        raise ConfineError(f"{field}: {user_path!r} resolves outside the job's own directory {base}; "
                           "give a path inside it")
    return target


def static_path_error(user_path: str, *, field: str) -> str | None:
    """The error for a spec path that is absolute or climbs out with '..' (checked without the disk)."""
    p = PurePosixPath(user_path)
    if p.is_absolute() or user_path.startswith("~"):
        return f"{field}: {user_path!r} is absolute; give a path relative to the project's directory"
    if ".." in p.parts:
        return f"{field}: {user_path!r} climbs out with '..'; give a path inside the project's directory"
    if "\0" in user_path:
        return f"{field}: contains a NUL byte; remove it"
    return None


def spec_path_errors(spec: JobSpec) -> list[str]:
    """Paths a local job names (script, checkpoint dir) that could leave its roots."""
    s = spec.spec
    if s.backend != "local":
        return []  # in a container or on Azure ML the paths are the image's and the volume's own
    errors = []
    script = getattr(s.entrypoint, "script", None)
    if script is not None and (e := static_path_error(script, field="spec.entrypoint.script")):
        errors.append(e)
    if s.checkpoint is not None and (e := static_path_error(s.checkpoint.dir, field="spec.checkpoint.dir")):
        errors.append(e)
    return errors


def factory_error(factory: str, *, allowed: tuple[str, ...]) -> str | None:
    """Why `factory` ("pkg.mod:fn") may not be named, or None. A factory is a module of the job's own code
    directory or under an admin allow-listed prefix; the standard library, deepfleet itself and the
    controller's packages are refused."""
    module = factory.partition(":")[0]
    if _allowed(module, allowed):
        return None
    top = module.split(".")[0]
    if top in _FORBIDDEN_TOP or top.startswith("_"):
        return (f"spec.entrypoint.factory: {factory!r} names the {top!r} package, not the job's own code; "
                "name a function of your project's code (an admin can allow-list module prefixes)")
    return None


def _allowed(module: str, allowed: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in allowed if p)


def copy_resume_checkpoint(source: JobArea, *, into: Path) -> str | None:
    """Copy the newest complete checkpoint of `source` into `into` (a checkpoint dir of the new job), as
    `<into>/<tag>` plus `latest`; returns the tag, or None when the source has none. Links inside the
    source are not followed out of it."""
    src_root = source.checkpoints.resolve()
    for latest in sorted(src_root.rglob("latest")):
        if latest.is_symlink() or not latest.is_file():
            continue
        tag = latest.read_text()[:255].strip()
        tag_dir = latest.parent / tag
        if not tag or "/" in tag or tag_dir.is_symlink() or not (tag_dir / "COMPLETE").is_file():
            continue
        resolve_inside(src_root, str(tag_dir.relative_to(src_root)), field="checkpoint.resumeFrom")
        into.mkdir(parents=True, exist_ok=True)
        if not (into / tag).exists():
            shutil.copytree(tag_dir, into / tag, symlinks=True)
        (into / "latest").write_text(tag)
        return tag
    return None
