"""The model manifest (initialization/model-assets.json): its format, its entries, and strict parsing."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from specter.errors import SpecterError

FORMAT = "specter-model-assets/1"
LOCK_NAME = ".specter-download.json"  # names the downloader writes inside a model directory
PARTIAL_SUFFIX = ".partial"
ASIDE_SUFFIX = ".mismatch"  # a local file the downloader replaces, kept until the replacement is verified
STAGING_DIR = ".specter-staging"  # huggingface_hub's local_dir (keeps its resumable partial downloads)
_COMMIT = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


class UsageError(SpecterError):
    """Bad command line or manifest: a one-line error, exit code 2."""


class ManifestError(UsageError):
    """The manifest is not valid JSON, has the wrong format, misses keys or has a malformed value."""


class DownloadError(SpecterError):
    """A file could not be fetched, or failed its check: a one-line error, exit code 1."""


class RemoteFileMissing(DownloadError):
    """The repository has no such file at that revision (allowed for files marked optional)."""


class ChecksumError(DownloadError):
    """A file's size or SHA-256 differs from the expected one."""


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative POSIX path inside the repository (and inside DIR/<name>/)
    size: int | None  # bytes; None = unknown
    sha256: str | None  # lowercase hex; None = unknown
    optional: bool = False


@dataclass(frozen=True)
class ModelEntry:
    name: str
    repo_id: str
    revision: str
    revision_pinned: bool
    optional: bool
    files: tuple[FileEntry, ...]




# ----------------------------------------------------------------------------------------------- manifest

class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


def _object(value: object, where: str, required: set[str], allowed: set[str] = frozenset()) -> dict:
    if not isinstance(value, dict):
        raise ManifestError(f"{where} must be a JSON object")
    missing = sorted(required - value.keys())
    if missing:
        raise ManifestError(f"{where} is missing key(s): {', '.join(missing)}")
    unknown = sorted(value.keys() - required - allowed)
    if unknown:
        raise ManifestError(f"{where} has unknown key(s): {', '.join(unknown)}")
    return value


def _bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise ManifestError(f"{where} must be true or false, not {value!r}")
    return value


def _parse_file(raw: object, where: str) -> FileEntry:
    spec = _object(raw, where, {"path", "size", "sha256"}, {"optional", "note"})
    path = spec["path"]
    if not isinstance(path, str) or not path or "\\" in path:
        raise ManifestError(f"{where}.path must be a relative path with / separators, not {path!r}")
    pure = PurePosixPath(path)
    if pure.is_absolute() or any(part in ("", ".", "..") for part in path.split("/")):
        raise ManifestError(f"{where}.path {path!r} must stay inside the model directory (no /, . or .. parts)")
    if pure.name.endswith(PARTIAL_SUFFIX) or pure.parts[0] in (LOCK_NAME, STAGING_DIR):
        raise ManifestError(f"{where}.path {path!r} clashes with a name the downloader uses")
    size = spec["size"]
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
        raise ManifestError(f"{where}.size must be a byte count or null, not {size!r}")
    sha = spec["sha256"]
    if sha is not None and (not isinstance(sha, str) or not _SHA256.fullmatch(sha)):
        raise ManifestError(f"{where}.sha256 must be 64 hex digits or null, not {sha!r}")
    optional = _bool(spec.get("optional", False), f"{where}.optional")
    return FileEntry(path, size, sha.lower() if sha else None, optional)


def _parse_model(name: str, raw: object, where: str) -> ModelEntry:
    if not _NAME.fullmatch(name):
        raise ManifestError(f"{where}: model name {name!r} must be lowercase letters, digits, '.', '_' or '-'")
    spec = _object(raw, where, {"repo_id", "revision", "files"}, {"revision_pinned", "optional", "note"})
    repo_id, revision = spec["repo_id"], spec["revision"]
    if not isinstance(repo_id, str) or not _REPO_ID.fullmatch(repo_id):
        raise ManifestError(f"{where}.repo_id must look like 'owner/name', not {repo_id!r}")
    if not isinstance(revision, str) or not revision.strip():
        raise ManifestError(f"{where}.revision must be a non-empty string")
    pinned = _bool(spec.get("revision_pinned", True), f"{where}.revision_pinned")
    if pinned and not _COMMIT.fullmatch(revision):
        raise ManifestError(f"{where}.revision {revision!r} is not a 40-hex commit; pin it, or set "
                            f"\"revision_pinned\": false and say why in \"note\"")
    optional = _bool(spec.get("optional", False), f"{where}.optional")
    files = spec["files"]
    if not isinstance(files, list) or not files:
        raise ManifestError(f"{where}.files must be a non-empty list")
    entries = tuple(_parse_file(item, f"{where}.files[{i}]") for i, item in enumerate(files))
    paths = [e.path for e in entries]
    dupes = sorted({p for p in paths if paths.count(p) > 1})
    if dupes:
        raise ManifestError(f"{where}.files lists {', '.join(dupes)} more than once")
    return ModelEntry(name, repo_id, revision, pinned, optional, entries)


def load_manifest(path: str | os.PathLike) -> dict[str, ModelEntry]:
    """Parse and check a specter-model-assets/1 manifest; every problem is a one-line ManifestError."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ManifestError(f"manifest {path} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(f"cannot read manifest {path}: {first_line(exc)}") from None
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise ManifestError(f"manifest {path} is not valid JSON: {exc.msg} (line {exc.lineno}, "
                            f"column {exc.colno})") from None
    except _DuplicateKey as exc:
        raise ManifestError(f"manifest {path} has the key {exc.args[0]!r} twice in one object") from None
    data = _object(data, f"manifest {path}", {"format", "models"}, {"comment"})
    if data["format"] != FORMAT:
        raise ManifestError(f"manifest {path} has format {data['format']!r}, expected {FORMAT!r}")
    models = data["models"]
    if not isinstance(models, dict) or not models:
        raise ManifestError(f"manifest {path}: models must be a non-empty object (name -> model)")
    return {name: _parse_model(name, raw, f"{path}: models.{name}") for name, raw in models.items()}


def select_models(models: dict[str, ModelEntry], only: list[str] | None) -> list[ModelEntry]:
    """The models named by --only (in that order), or all models not marked optional."""
    if not only:
        return [m for m in models.values() if not m.optional]
    unknown = [n for n in only if n not in models]
    if unknown:
        raise UsageError(f"unknown model {unknown[0]!r} in --only; the manifest has: {', '.join(models)}")
    return [models[n] for n in dict.fromkeys(only)]


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none), for one-line errors."""
    text = str(exc).strip()
    return text.splitlines()[0].strip().rstrip(".") if text else type(exc).__name__
