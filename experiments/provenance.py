"""Which commit a result came from: the project's own git repository, or $SPECTER_COMMIT, else unknown."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the project's top level
COMMIT_VARIABLE = "SPECTER_COMMIT"  # names the commit of a copy without its own .git (e.g. a GPU machine's)


def git(args: list[str], root: Path) -> str | None:
    """`git ARGS` run in `root`: its stripped output, None where git fails or is missing."""
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def own_repository(root: Path = ROOT) -> bool:
    """Whether `root` is the top level of a git work tree: a copy of the project inside another repository
    (whose commit says nothing of these files) is not."""
    top = git(["rev-parse", "--show-toplevel"], root)
    return top is not None and Path(top).resolve() == root.resolve()


def commit(root: Path = ROOT, short: bool = False) -> str | None:
    """$SPECTER_COMMIT where set; else HEAD of the project's own repository; else None (unknown)."""
    if os.environ.get(COMMIT_VARIABLE):
        return os.environ[COMMIT_VARIABLE]
    if not own_repository(root):
        return None
    return git(["rev-parse", *(["--short"] if short else []), "HEAD"], root)


def dirty(root: Path = ROOT) -> bool | None:
    """Whether tracked files differ from the project repository's HEAD; None where that is not known (no own
    repository, or the commit named by $SPECTER_COMMIT)."""
    if os.environ.get(COMMIT_VARIABLE) or not own_repository(root):
        return None
    status = git(["status", "--porcelain", "--untracked-files=no"], root)
    return None if status is None else bool(status)
