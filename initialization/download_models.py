"""Download the registered full-size checkpoints from the Hugging Face Hub at pinned revisions, SHA-256 checked."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__" and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script: use this checkout's specter package

import huggingface_hub  # noqa: E402
from huggingface_hub import errors as hf_errors  # noqa: E402
from tqdm import tqdm  # noqa: E402

from initialization.manifest import (  # noqa: E402
    ASIDE_SUFFIX,
    LOCK_NAME,
    PARTIAL_SUFFIX,
    STAGING_DIR,
    ChecksumError,
    DownloadError,
    FileEntry,
    ManifestError,  # noqa: F401  (re-exported: the public errors of this command)
    ModelEntry,
    RemoteFileMissing,
    UsageError,
    first_line,
    load_manifest,
    select_models,
)
from specter.cli import run_cli  # noqa: E402
from specter.errors import SpecterError  # noqa: E402

LOCK_FORMAT = "specter-download-lock/1"
DEFAULT_MANIFEST = ROOT / "initialization" / "model-assets.json"
# fetch(repo_id, filename, revision, local_dir) -> path of the downloaded file (somewhere under local_dir)
Fetch = Callable[[str, str, str, Path], "str | os.PathLike[str]"]
CHUNK_BYTES = 8 << 20


HELP_EPILOG = f"""\
Each model goes to DIR/<name>/ (what specter's loader reads as $SPECTER_MODELS/<name>). Every file is
fetched with huggingface_hub, moved to <file>{PARTIAL_SUFFIX}, checked against the manifest's size and
sha256 and only then renamed to its final name. Files already present and matching are skipped, so an
interrupted run is resumed by running it again. A file whose sha256 the manifest leaves null is
downloaded, its observed sha256 recorded in DIR/<name>/{LOCK_NAME}, and a warning says that it was not
verifiable against the manifest; later runs compare it with the recorded hash. A local file that does
not match is never deleted: it is moved to <file>{ASIDE_SUFFIX} and removed only once a download verified
against the manifest has replaced it.

Without --only, every model not marked optional is downloaded (optional ones: name them with --only).
Gated repositories need `hf auth login` or HF_TOKEN. Exit codes: 0 ok, 1 a download or check failed,
2 bad manifest or command line.
"""


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

def hf_fetch(repo_id: str, filename: str, revision: str, local_dir: Path) -> str:
    """huggingface_hub.hf_hub_download into local_dir, its errors turned into one-line DownloadErrors."""
    where = f"{filename} from {repo_id}@{revision}"
    try:
        return huggingface_hub.hf_hub_download(repo_id, filename, revision=revision, local_dir=local_dir)
    except hf_errors.LocalEntryNotFoundError as exc:  # could not reach the Hub (or HF_HUB_OFFLINE=1)
        raise DownloadError(f"cannot download {where}: {first_line(exc)}; this machine may have no network "
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
        raise DownloadError(f"cannot download {where}: {first_line(exc)}") from None
    except OSError as exc:
        if exc.errno is not None and exc.filename:  # the local disk, not the network
            raise DownloadError(f"cannot download {where}: {exc.strerror}: {exc.filename}") from None
        raise DownloadError(f"cannot download {where}: {first_line(exc)}; this machine may have no "
                            f"network") from None
    except Exception as exc:  # noqa: BLE001 (httpx transport, Xet, ...: one line, not a traceback)
        raise DownloadError(f"cannot download {where}: {type(exc).__name__}: {first_line(exc)}; this machine "
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
        _warn(f"ignoring unreadable lock file {path}: {first_line(exc)}")
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
        _warn(f"{exc}; downloading it again")
        return None


def move_aside(final: Path, label: str) -> Path:
    """Rename an existing file that is about to be replaced to <name>.mismatch (.mismatch.1, ... if taken):
    it is kept until a replacement verified against the manifest is in place."""
    aside, n = final.with_name(final.name + ASIDE_SUFFIX), 0
    while aside.exists():
        n += 1
        aside = final.with_name(f"{final.name}{ASIDE_SUFFIX}.{n}")
    os.replace(final, aside)
    _warn(f"{label}: the local copy was moved aside to {aside}; it is kept until a verified replacement is in place")
    return aside


def settle_aside(aside: Path | None, entry: FileEntry, label: str) -> None:
    """Remove the moved-aside copy once its replacement is verified against the manifest; otherwise keep it."""
    if aside is None:
        return
    if entry.sha256 is not None:
        aside.unlink()
        _say(f"{label}: replaced by a verified download; removed the mismatched copy {aside.name}")
    else:
        _warn(f"{label}: the manifest has no sha256, so the replacement is not verified; kept the earlier copy "
              f"at {aside}")


def download_file(model: ModelEntry, entry: FileEntry, model_dir: Path, lock: dict[str, dict],
                  fetch: Fetch | None = None, force: bool = False) -> str:
    """Fetch one file to <path>.partial, verify it, rename it; returns skipped|downloaded|unverified|missing.

    `lock` (path -> record) is updated in place and written after each download, so an interruption loses at
    most the file in flight. A mismatch deletes the partial file and raises ChecksumError. A local file this
    run replaces is moved aside first (`move_aside`), never deleted before a verified copy is in place.
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
    aside = move_aside(final, label) if final.is_file() else None
    partial.unlink(missing_ok=True)
    staging = model_dir / STAGING_DIR
    if force:
        (staging / entry.path).unlink(missing_ok=True)  # no stale copy from an earlier run
    try:
        fetched = Path(fetch(model.repo_id, entry.path, model.revision, staging))
    except RemoteFileMissing as exc:
        if aside is not None:
            os.replace(aside, final)  # nothing to replace it with: the local copy goes back
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
    settle_aside(aside, entry, label)
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
