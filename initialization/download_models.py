"""Download the registered full-size checkpoints from the Hugging Face Hub at pinned revisions, SHA-256 checked."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__" and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script: use this checkout's specter package

import huggingface_hub  # noqa: E402
from huggingface_hub import errors as hf_errors  # noqa: E402
from tqdm import tqdm  # noqa: E402

from specter.cli import run_cli  # noqa: E402
from specter.errors import SpecterError  # noqa: E402

FORMAT = "specter-model-assets/1"
LOCK_FORMAT = "specter-download-lock/1"
LOCK_NAME = ".specter-download.json"
PARTIAL_SUFFIX = ".partial"
STAGING_DIR = ".specter-staging"  # huggingface_hub's local_dir (keeps its resumable partial downloads)
DEFAULT_MANIFEST = ROOT / "initialization" / "model-assets.json"
CHUNK_BYTES = 8 << 20

_COMMIT = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")

HELP_EPILOG = f"""\
Each model goes to DIR/<name>/ (what specter's loader reads as $SPECTER_MODELS/<name>). Every file is
fetched with huggingface_hub, moved to <file>{PARTIAL_SUFFIX}, checked against the manifest's size and
sha256 and only then renamed to its final name. Files already present and matching are skipped, so an
interrupted run is resumed by running it again. A file whose sha256 the manifest leaves null is
downloaded, its observed sha256 recorded in DIR/<name>/{LOCK_NAME}, and a warning says that it was not
verifiable against the manifest; later runs compare it with the recorded hash.

Without --only, every model not marked optional is downloaded (optional ones: name them with --only).
Gated repositories need `hf auth login` or HF_TOKEN. Exit codes: 0 ok, 1 a download or check failed,
2 bad manifest or command line.
"""


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


# fetch(repo_id, filename, revision, local_dir) -> path of the downloaded file (somewhere under local_dir)
Fetch = Callable[[str, str, str, Path], "str | os.PathLike[str]"]


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
        raise ManifestError(f"cannot read manifest {path}: {_first_line(exc)}") from None
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


# ------------------------------------------------------------------------------------------- verification

def sha256_file(path: str | os.PathLike, chunk_bytes: int = CHUNK_BYTES) -> str:
    """SHA-256 of a file, read in chunks (never the whole file in memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def verify_file(path: str | os.PathLike, sha256: str | None, size: int | None, label: str | None = None) -> str:
    """Check a file's size and SHA-256 (each when given) and return its SHA-256; ChecksumError on a mismatch."""
    path = Path(path)
    label = label or str(path)
    actual_size = path.stat().st_size
    if size is not None and actual_size != size:
        raise ChecksumError(f"size mismatch for {label}: expected {size} bytes, got {actual_size}")
    actual = sha256_file(path)
    if sha256 is not None and actual != sha256:
        raise ChecksumError(f"checksum mismatch for {label}: expected sha256 {sha256}, got {actual}")
    return actual


# ------------------------------------------------------------------------------------------------ fetching

def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0].strip().rstrip(".") if text else type(exc).__name__


def hf_fetch(repo_id: str, filename: str, revision: str, local_dir: Path) -> str:
    """huggingface_hub.hf_hub_download into local_dir, its errors turned into one-line DownloadErrors."""
    where = f"{filename} from {repo_id}@{revision}"
    try:
        return huggingface_hub.hf_hub_download(repo_id, filename, revision=revision, local_dir=local_dir)
    except hf_errors.LocalEntryNotFoundError as exc:  # could not reach the Hub (or HF_HUB_OFFLINE=1)
        raise DownloadError(f"cannot download {where}: {_first_line(exc)}; this machine may have no network "
                            f"(or HF_HUB_OFFLINE is set)") from None
    except hf_errors.GatedRepoError:
        raise DownloadError(f"cannot download {where}: the repository is gated; accept its terms on "
                            f"https://huggingface.co/{repo_id} and log in (`hf auth login` or HF_TOKEN)") from None
    except hf_errors.RepositoryNotFoundError:
        raise DownloadError(f"cannot download {where}: repository not found (or private: log in with "
                            f"`hf auth login` or HF_TOKEN)") from None
    except hf_errors.RevisionNotFoundError:
        raise DownloadError(f"cannot download {where}: revision {revision} not found in {repo_id}") from None
    except hf_errors.RemoteEntryNotFoundError:
        raise RemoteFileMissing(f"cannot download {where}: the repository has no such file at this "
                                f"revision") from None
    except hf_errors.HfHubHTTPError as exc:
        raise DownloadError(f"cannot download {where}: {_first_line(exc)}") from None
    except OSError as exc:
        if exc.errno is not None and exc.filename:  # the local disk, not the network
            raise DownloadError(f"cannot download {where}: {exc.strerror}: {exc.filename}") from None
        raise DownloadError(f"cannot download {where}: {_first_line(exc)}; this machine may have no "
                            f"network") from None
    except Exception as exc:  # noqa: BLE001 (httpx transport, Xet, ...: one line, not a traceback)
        raise DownloadError(f"cannot download {where}: {type(exc).__name__}: {_first_line(exc)}; this machine "
                            f"may have no network") from None


# ---------------------------------------------------------------------------------------------- lock file

def _say(message: str) -> None:
    tqdm.write(message, file=sys.stdout)


def _warn(message: str) -> None:
    tqdm.write(f"warning: {message}", file=sys.stderr)


def read_lock(model_dir: Path, model: ModelEntry) -> dict[str, dict]:
    """Per-file records of an earlier download of the same repo and revision ({} if none or stale)."""
    path = model_dir / LOCK_NAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        _warn(f"ignoring unreadable lock file {path}: {_first_line(exc)}")
        return {}
    if (not isinstance(data, dict) or data.get("format") != LOCK_FORMAT or data.get("repo_id") != model.repo_id
            or data.get("revision") != model.revision or not isinstance(data.get("files"), dict)):
        return {}
    return {k: v for k, v in data["files"].items() if isinstance(v, dict) and isinstance(v.get("sha256"), str)}


def write_lock(model_dir: Path, model: ModelEntry, records: dict[str, dict]) -> Path:
    """Write DIR/<name>/.specter-download.json atomically (temporary file, then rename)."""
    path = model_dir / LOCK_NAME
    data = {"format": LOCK_FORMAT, "model": model.name, "repo_id": model.repo_id, "revision": model.revision,
            "revision_pinned": model.revision_pinned, "files": dict(sorted(records.items()))}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def _record(path: Path, sha256: str, entry: FileEntry) -> dict:
    return {"sha256": sha256, "size": path.stat().st_size, "verified": entry.sha256 is not None}


# ------------------------------------------------------------------------------------------------ download

def _present_and_valid(final: Path, entry: FileEntry, recorded: dict | None, label: str) -> str | None:
    """The SHA-256 of an existing final file if it matches the manifest (or, hash unknown, the lock file)."""
    expected = entry.sha256 or (recorded or {}).get("sha256")
    if expected is None:
        _say(f"{label}: present but its hash is neither in the manifest nor in the lock file; downloading it again")
        return None
    try:
        return verify_file(final, expected, entry.size, label)
    except ChecksumError as exc:
        if entry.sha256 is not None or (entry.size is not None and final.stat().st_size != entry.size):
            final.unlink()  # contradicts the manifest: never leave it under the final name
        _warn(f"{exc}; downloading it again")
        return None


def download_file(model: ModelEntry, entry: FileEntry, model_dir: Path, lock: dict[str, dict],
                  fetch: Fetch | None = None, force: bool = False) -> str:
    """Fetch one file to <path>.partial, verify it, rename it; returns skipped|downloaded|unverified|missing.

    `lock` (path -> record) is updated in place and written after each download, so an interruption loses at
    most the file in flight. A mismatch deletes the partial file and raises ChecksumError.
    """
    fetch = fetch or hf_fetch
    label = f"{model.name}/{entry.path}"
    final = model_dir / entry.path
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    if final.is_file() and not force:
        sha = _present_and_valid(final, entry, lock.get(entry.path), label)
        if sha is not None:
            lock[entry.path] = _record(final, sha, entry)
            _say(f"{label}: already present and matching, skipped")
            return "skipped"
    final.parent.mkdir(parents=True, exist_ok=True)
    partial.unlink(missing_ok=True)
    staging = model_dir / STAGING_DIR
    if force:
        (staging / entry.path).unlink(missing_ok=True)  # no stale copy from an earlier run
    try:
        fetched = Path(fetch(model.repo_id, entry.path, model.revision, staging))
    except RemoteFileMissing as exc:
        if not entry.optional:
            raise
        _warn(f"{exc}; it is optional, skipped")
        return "missing"
    shutil.move(fetched, partial)
    try:
        sha = verify_file(partial, entry.sha256, entry.size, label)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, final)
    lock[entry.path] = _record(final, sha, entry)
    lock_path = write_lock(model_dir, model, lock)
    if entry.sha256 is None:
        _warn(f"{label}: the manifest has no sha256 for it, so it was not verifiable against the manifest; "
              f"recorded its sha256 {sha} in {lock_path}")
        return "unverified"
    _say(f"{label}: downloaded and verified")
    return "downloaded"


def download_model(model: ModelEntry, output: str | os.PathLike, fetch: Fetch | None = None,
                   force: bool = False) -> dict[str, list[str]]:
    """Download one model's files into output/<name>/; returns {status: [paths]} (see download_file)."""
    model_dir = Path(output) / model.name
    model_dir.mkdir(parents=True, exist_ok=True)
    if not model.revision_pinned:
        _warn(f"{model.name}: revision {model.revision!r} of {model.repo_id} is not pinned; the files may "
              f"change upstream and the lock file then only says what was downloaded")
    lock = read_lock(model_dir, model)
    results: dict[str, list[str]] = {"skipped": [], "downloaded": [], "unverified": [], "missing": []}
    with tqdm(model.files, desc=model.name, unit="file", disable=None) as bar:
        for entry in bar:
            bar.set_postfix_str(entry.path, refresh=False)
            results[download_file(model, entry, model_dir, lock, fetch=fetch, force=force)].append(entry.path)
    write_lock(model_dir, model, lock)
    shutil.rmtree(model_dir / STAGING_DIR, ignore_errors=True)
    return results


# -------------------------------------------------------------------------------------------------- CLI

def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.1f} GB"


def list_models(models: list[ModelEntry], output: Path | None) -> None:
    """One line per model: repo@revision, files, known size and hashes, and what is already in output/."""
    for m in models:
        sizes = [f.size for f in m.files if f.size is not None]
        if not sizes:
            size = "unknown"
        elif len(sizes) == len(m.files):
            size = _gb(sum(sizes))
        else:
            size = f"at least {_gb(sum(sizes))} (known for {len(sizes)}/{len(m.files)} files)"
        hashes = sum(f.sha256 is not None for f in m.files)
        flags = ([] if m.revision_pinned else ["revision NOT pinned"]) + (["optional"] if m.optional else [])
        line = (f"{m.name:<8} {m.repo_id}@{m.revision[:12]}  {len(m.files)} files, size {size}, "
                f"sha256 known for {hashes}/{len(m.files)}")
        if flags:
            line += f" ({', '.join(flags)})"
        if output is not None:
            present = sum((output / m.name / f.path).is_file() for f in m.files)
            line += f"; {present}/{len(m.files)} present in {output / m.name}"
        print(line)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="download_models.py", description=__doc__, epilog=HELP_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--manifest", type=Path, default=DEFAULT_MANIFEST,
                   help="model asset manifest (default: initialization/model-assets.json)")
    p.add_argument("--output", type=Path, default=None, help="directory to put DIR/<name>/ in (required unless --list)")
    p.add_argument("--only", nargs="+", metavar="NAME", default=None,
                   help="download only these models (default: every model not marked optional)")
    p.add_argument("--list", action="store_true", help="list the manifest's models (and what --output holds) and exit")
    p.add_argument("--force", action="store_true", help="download again even files that are present and match")
    return p


def run(args: argparse.Namespace) -> int:
    models = load_manifest(args.manifest)
    selected = select_models(models, args.only)
    if args.list:
        list_models(selected if args.only else list(models.values()), args.output)
        return 0
    if args.output is None:
        raise UsageError("--output DIR is required (or use --list)")
    output = args.output.expanduser().resolve()
    totals: dict[str, int] = {}
    unverified: list[str] = []
    for model in selected:
        results = download_model(model, output, force=args.force)
        for status, paths in results.items():
            totals[status] = totals.get(status, 0) + len(paths)
        if results["unverified"]:
            unverified.append(f"{len(results['unverified'])} in {output / model.name / LOCK_NAME}")
    print(f"done: {', '.join(m.name for m in selected)} in {output} ({totals.get('downloaded', 0)} downloaded "
          f"and verified, {totals.get('skipped', 0)} already present, {totals.get('unverified', 0)} downloaded "
          f"without a manifest hash, {totals.get('missing', 0)} optional files missing)")
    if unverified:
        _warn(f"files not verifiable against the manifest, their hashes recorded: {'; '.join(unverified)}")
    print(f"to load them: export SPECTER_MODELS={shlex.quote(str(output))}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (0 ok, 1 download or check failed, 2 bad manifest or arguments)."""
    args = build_parser().parse_args(argv)
    return run_cli(lambda: run(args), codes=((UsageError, 2), (SpecterError, 1)), other=1,
                   interrupted="; run the same command again to resume")


if __name__ == "__main__":
    sys.exit(main())
