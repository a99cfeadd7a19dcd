"""initialization/download_models.py: manifest checks, SHA-256 verification, resumable downloads (fake fetch, no network)."""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import httpx
import pytest
from huggingface_hub import errors as hf_errors

from initialization import download_models as dm
from initialization import manifest
from specter.models.registry import FULL_MODELS, get_spec

COMMIT = "0123456789abcdef0123456789abcdef01234567"
FILES = {"config.json": b'{"model_type": "mixtral"}\n', "model-00001-of-00002.safetensors": b"\x00" * 1000 + b"w1",
         "sub/model-00002-of-00002.safetensors": b"weights two" * 50}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest_dict(known: bool = True, **model_overrides) -> dict:
    files = [{"path": p, "size": len(b) if known else None, "sha256": sha(b) if known else None}
             for p, b in FILES.items()]
    model = {"repo_id": "owner/repo", "revision": COMMIT, "files": files, **model_overrides}
    return {"format": manifest.FORMAT, "models": {"toy": model, "extra": {**model, "optional": True}}}


def write_manifest(tmp_path: Path, data) -> Path:
    path = tmp_path / "assets.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


class FakeHub:
    """A fetch function: writes the bytes of `files` (path -> bytes) under local_dir, counting calls."""

    def __init__(self, files: dict[str, bytes] = FILES):
        self.files = dict(files)
        self.calls: list[str] = []
        self.revisions: set[str] = set()

    def __call__(self, repo_id, filename, revision, local_dir):
        assert repo_id == "owner/repo"
        self.calls.append(filename)
        self.revisions.add(revision)
        if filename not in self.files:
            raise dm.RemoteFileMissing(f"cannot download {filename}: no such file")
        target = Path(local_dir) / filename
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(self.files[filename])
        return str(target)


def no_fetch(*args):
    raise AssertionError(f"fetch called: {args}")


def toy(tmp_path: Path, known: bool = True, **overrides) -> dm.ModelEntry:
    return dm.load_manifest(write_manifest(tmp_path, manifest_dict(known, **overrides)))["toy"]


def leftovers(model_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(model_dir)) for p in model_dir.rglob("*")
                  if p.name.endswith(dm.PARTIAL_SUFFIX) or dm.STAGING_DIR in p.parts)


# --------------------------------------------------------------------------------------------- manifest

def test_shipped_manifest_names_the_registered_full_size_models():
    models = dm.load_manifest(dm.DEFAULT_MANIFEST)
    assert set(models) == set(FULL_MODELS) == {"dsv2", "qwen", "phi", "mixtral"}
    for name, model in models.items():
        assert model.repo_id == get_spec(name).hf_repo
        assert model.optional == (name == "mixtral")
        assert model.revision_pinned == bool(re.fullmatch(r"[0-9a-f]{40}", model.revision))
        paths = [f.path for f in model.files if not f.optional]
        assert "config.json" in paths and "model.safetensors.index.json" in paths
        shards = [re.fullmatch(r"model-(\d+)-of-(\d+)\.safetensors", p) for p in paths]
        shards = [m for m in shards if m]
        assert shards, name
        total = {int(m.group(2)) for m in shards}
        assert len(total) == 1 and sorted(int(m.group(1)) for m in shards) == list(range(1, total.pop() + 1)), name
    assert [m.name for m in dm.select_models(models, None)] == ["dsv2", "qwen", "phi"]


def test_load_manifest_good(tmp_path):
    data = manifest_dict()
    data["models"]["toy"]["files"][0]["sha256"] = sha(FILES["config.json"]).upper()
    data["models"]["toy"]["files"][0]["note"] = "free text"
    models = dm.load_manifest(write_manifest(tmp_path, data))
    model = models["toy"]
    assert (model.repo_id, model.revision, model.revision_pinned, model.optional) == ("owner/repo", COMMIT, True, False)
    assert model.files[0] == dm.FileEntry("config.json", len(FILES["config.json"]), sha(FILES["config.json"]))
    assert models["extra"].optional
    assert [m.name for m in dm.select_models(models, None)] == ["toy"]
    assert [m.name for m in dm.select_models(models, ["extra", "toy", "extra"])] == ["extra", "toy"]


def test_unpinned_revision_needs_revision_pinned_false(tmp_path):
    with pytest.raises(dm.ManifestError, match="not a 40-hex commit"):
        toy(tmp_path, revision="main")
    model = toy(tmp_path, revision="main", revision_pinned=False, note="pin me")
    assert not model.revision_pinned


def edit(data: dict, where: str, value) -> dict:
    """Set (or, value=KeyError, delete) a dotted key such as 'models.toy.files.0.sha256'."""
    *parents, last = where.split(".")
    node = data
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is KeyError:
        del node[int(last) if isinstance(node, list) else last]
    else:
        node[int(last) if isinstance(node, list) else last] = value
    return data


@pytest.mark.parametrize("where,value,message", [
    ("format", "specter-model-assets/2", "expected 'specter-model-assets/1'"),
    ("format", KeyError, "missing key(s): format"),
    ("models", {}, "non-empty"),
    ("models.toy.repo_id", KeyError, "missing key(s): repo_id"),
    ("models.toy.files.0.sha256", KeyError, "missing key(s): sha256"),
    ("models.toy.files.0.size", KeyError, "missing key(s): size"),
    ("models.toy.files.0.sha256", "abc123", "64 hex digits"),
    ("models.toy.files.0.sha256", "g" * 64, "64 hex digits"),
    ("models.toy.files.0.size", -1, "byte count"),
    ("models.toy.files.0.size", "12", "byte count"),
    ("models.toy.files.0.path", "../escape.json", "inside the model directory"),
    ("models.toy.files.0.path", "/abs.json", "inside the model directory"),
    ("models.toy.files.0.optinal", True, "unknown key(s): optinal"),
    ("models.toy.files.1.path", "config.json", "more than once"),
    ("models.toy.repo_id", "no-slash", "owner/name"),
    ("models.toy.files", [], "non-empty list"),
])
def test_corrupt_manifest_is_a_one_line_error_with_exit_code_2(tmp_path, capsys, where, value, message):
    path = write_manifest(tmp_path, edit(manifest_dict(), where, value))
    with pytest.raises(dm.ManifestError) as info:
        dm.load_manifest(path)
    assert message in str(info.value)
    assert dm.main(["--manifest", str(path), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("text,message", [
    ('{"format": "specter-model-assets/1", "models": {', "is not valid JSON"),
    ("", "is not valid JSON"),
    ('["a list"]', "must be a JSON object"),
    ('{"format": "specter-model-assets/1", "format": "x", "models": {}}', "the key 'format' twice"),
])
def test_unparsable_manifest(tmp_path, capsys, text, message):
    assert dm.main(["--manifest", str(write_manifest(tmp_path, text)), "--list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1


def test_missing_manifest_and_unknown_only(tmp_path, capsys):
    assert dm.main(["--manifest", str(tmp_path / "nope.json"), "--list"]) == 2
    assert "not found" in capsys.readouterr().err
    path = write_manifest(tmp_path, manifest_dict())
    assert dm.main(["--manifest", str(path), "--output", str(tmp_path / "out"), "--only", "toy", "dsv3"]) == 2
    err = capsys.readouterr().err
    assert err == "error: unknown model 'dsv3' in --only; the manifest has: toy, extra\n"
    assert dm.main(["--manifest", str(path)]) == 2  # neither --output nor --list
    assert "--output DIR is required" in capsys.readouterr().err


def test_list(tmp_path, capsys):
    path = write_manifest(tmp_path, manifest_dict())
    assert dm.main(["--manifest", str(path), "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0].startswith("toy") and "sha256 known for 3/3" in out[0] and "optional" in out[1]


# ------------------------------------------------------------------------------------------ verification

def test_verify_file(tmp_path):
    path = tmp_path / "blob.bin"
    data = bytes(range(256)) * 1000
    path.write_bytes(data)
    assert dm.sha256_file(path, chunk_bytes=1000) == sha(data)  # chunked: several reads, same digest
    assert dm.verify_file(path, sha(data), len(data)) == sha(data)
    assert dm.verify_file(path, None, None) == sha(data)
    with pytest.raises(dm.ChecksumError) as info:
        dm.verify_file(path, "0" * 64, None, label="toy/blob.bin")
    assert str(info.value) == f"checksum mismatch for toy/blob.bin: expected sha256 {'0' * 64}, got {sha(data)}"
    with pytest.raises(dm.ChecksumError, match=f"size mismatch for .*blob.bin: expected 5 bytes, got {len(data)}"):
        dm.verify_file(path, sha(data), 5)


# ------------------------------------------------------------------------------------------- downloading

def test_download_verifies_and_writes_lock(tmp_path, capsys):
    model, hub = toy(tmp_path), FakeHub()
    results = dm.download_model(model, tmp_path / "out", fetch=hub)
    model_dir = tmp_path / "out" / "toy"
    assert results["downloaded"] == list(FILES) and hub.calls == list(FILES)
    for path, data in FILES.items():
        assert (model_dir / path).read_bytes() == data
    assert leftovers(model_dir) == []
    lock = json.loads((model_dir / dm.LOCK_NAME).read_text())
    assert (lock["format"], lock["repo_id"], lock["revision"]) == (dm.LOCK_FORMAT, "owner/repo", COMMIT)
    assert lock["files"]["config.json"] == {"sha256": sha(FILES["config.json"]), "size": len(FILES["config.json"]),
                                            "verified": True}
    assert "warning" not in capsys.readouterr().err


def test_mismatch_raises_and_leaves_no_file(tmp_path):
    model = toy(tmp_path)
    bad = FakeHub({**FILES, "model-00001-of-00002.safetensors": b"tampered"})
    with pytest.raises(dm.ChecksumError) as info:
        dm.download_model(model, tmp_path / "out", fetch=bad)
    assert str(info.value) == "size mismatch for toy/model-00001-of-00002.safetensors: expected 1002 bytes, got 8"
    model_dir = tmp_path / "out" / "toy"
    assert (model_dir / "config.json").is_file()  # verified before the bad one
    assert not (model_dir / "model-00001-of-00002.safetensors").exists()
    assert not list(model_dir.rglob("*" + dm.PARTIAL_SUFFIX))


def test_hash_mismatch_with_right_size(tmp_path):
    model = toy(tmp_path)
    same_size = b"\x01" * len(FILES["config.json"])
    with pytest.raises(dm.ChecksumError, match=f"expected sha256 {sha(FILES['config.json'])}, got {sha(same_size)}"):
        dm.download_model(model, tmp_path / "out", fetch=FakeHub({**FILES, "config.json": same_size}))
    assert not (tmp_path / "out" / "toy" / "config.json").exists()
    assert not list((tmp_path / "out").rglob("*" + dm.PARTIAL_SUFFIX))


def test_resume_skips_verified_files_and_force_refetches(tmp_path):
    model, out = toy(tmp_path), tmp_path / "out"
    dm.download_model(model, out, fetch=FakeHub())
    results = dm.download_model(model, out, fetch=no_fetch)
    assert results["skipped"] == list(FILES)
    hub = FakeHub()
    results = dm.download_model(model, out, fetch=hub, force=True)
    assert hub.calls == list(FILES) and results["downloaded"] == list(FILES)


def test_resume_after_interruption(tmp_path):
    model, out = toy(tmp_path), tmp_path / "out"

    def dies_on_second(repo_id, filename, revision, local_dir):
        if filename != "config.json":
            raise KeyboardInterrupt
        return FakeHub()(repo_id, filename, revision, local_dir)

    with pytest.raises(KeyboardInterrupt):
        dm.download_model(model, out, fetch=dies_on_second)
    (out / "toy" / "model-00001-of-00002.safetensors.partial").write_bytes(b"half")  # as a crash would leave it
    hub = FakeHub()
    results = dm.download_model(model, out, fetch=hub)
    assert results["skipped"] == ["config.json"] and hub.calls == list(FILES)[1:]
    assert leftovers(out / "toy") == []


def test_corrupt_final_file_is_replaced(tmp_path, capsys):
    model, out = toy(tmp_path), tmp_path / "out"
    dm.download_model(model, out, fetch=FakeHub())
    (out / "toy" / "config.json").write_bytes(b"edited")
    hub = FakeHub()
    dm.download_model(model, out, fetch=hub)
    assert hub.calls == ["config.json"]
    assert (out / "toy" / "config.json").read_bytes() == FILES["config.json"]
    err = capsys.readouterr()
    assert "downloading it again" in err.err and "moved aside" in err.err
    assert "removed the mismatched copy" in err.out
    assert not list((out / "toy").glob("*" + dm.ASIDE_SUFFIX + "*"))  # verified replacement: aside removed


def test_a_mismatched_local_file_is_kept_while_no_verified_replacement_exists(tmp_path, capsys):
    """A wrong manifest hash must not destroy a good download: the local file is moved aside, not deleted."""
    model, out = toy(tmp_path), tmp_path / "out"
    (out / "toy").mkdir(parents=True)
    good = b"x" * len(FILES["config.json"])  # the right size, another hash (as with a wrong manifest entry)
    (out / "toy" / "config.json").write_bytes(good)
    with pytest.raises(dm.ChecksumError):
        dm.download_model(model, out, fetch=FakeHub({**FILES, "config.json": good}))  # the hub agrees with the file
    assert (out / "toy" / ("config.json" + dm.ASIDE_SUFFIX)).read_bytes() == good
    assert "moved aside" in capsys.readouterr().err
    (out / "toy" / "config.json").write_bytes(good)  # a second run moves it aside again, under a new name
    with pytest.raises(dm.ChecksumError):
        dm.download_model(model, out, fetch=FakeHub({**FILES, "config.json": good}))
    assert (out / "toy" / ("config.json" + dm.ASIDE_SUFFIX + ".1")).read_bytes() == good


def test_an_unverifiable_replacement_keeps_the_earlier_copy(tmp_path, capsys):
    model, out = toy(tmp_path, known=False), tmp_path / "out"
    dm.download_model(model, out, fetch=FakeHub())
    dm.download_model(model, out, fetch=FakeHub(), force=True)
    assert (out / "toy" / ("config.json" + dm.ASIDE_SUFFIX)).read_bytes() == FILES["config.json"]
    assert "kept the earlier copy" in capsys.readouterr().err


def test_unknown_hash_is_recorded_and_warned(tmp_path, capsys):
    model, out = toy(tmp_path, known=False), tmp_path / "out"
    results = dm.download_model(model, out, fetch=FakeHub())
    assert results["unverified"] == list(FILES)
    err = capsys.readouterr().err
    assert err.count("not verifiable against the manifest") == len(FILES)
    assert all(line.startswith("warning: ") for line in err.strip().splitlines())
    lock = json.loads((out / "toy" / dm.LOCK_NAME).read_text())
    assert {p: r["sha256"] for p, r in lock["files"].items()} == {p: sha(b) for p, b in FILES.items()}
    assert not any(r["verified"] for r in lock["files"].values())
    # unchanged: skipped against the lock file, without fetching
    assert dm.download_model(model, out, fetch=no_fetch)["skipped"] == list(FILES)
    # changed on disk: fetched again
    (out / "toy" / "config.json").write_bytes(b"changed")
    hub = FakeHub()
    dm.download_model(model, out, fetch=hub)
    assert hub.calls == ["config.json"] and (out / "toy" / "config.json").read_bytes() == FILES["config.json"]


def test_lock_of_another_revision_is_not_trusted(tmp_path):
    out = tmp_path / "out"
    dm.download_model(toy(tmp_path, known=False), out, fetch=FakeHub())
    hub = FakeHub()
    dm.download_model(toy(tmp_path, known=False, revision="main", revision_pinned=False), out, fetch=hub)
    assert hub.calls == list(FILES) and hub.revisions == {"main"}


def test_optional_file_may_be_missing(tmp_path, capsys):
    data = manifest_dict()
    data["models"]["toy"]["files"].append({"path": "tokenizer.json", "size": None, "sha256": None, "optional": True})
    model = dm.load_manifest(write_manifest(tmp_path, data))["toy"]
    results = dm.download_model(model, tmp_path / "out", fetch=FakeHub())
    assert results["missing"] == ["tokenizer.json"] and results["downloaded"] == list(FILES)
    assert "it is optional, skipped" in capsys.readouterr().err
    data["models"]["toy"]["files"][-1]["optional"] = False
    model = dm.load_manifest(write_manifest(tmp_path, data))["toy"]
    with pytest.raises(dm.RemoteFileMissing):
        dm.download_model(model, tmp_path / "out", fetch=FakeHub())


def test_main_downloads_and_prints_the_hint(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(dm, "hf_fetch", FakeHub())
    path = write_manifest(tmp_path, manifest_dict())
    assert dm.main(["--manifest", str(path), "--output", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert f"export SPECTER_MODELS={tmp_path / 'out'}" in out
    assert not (tmp_path / "out" / "extra").exists()  # optional: only with --only
    assert dm.main(["--manifest", str(path), "--output", str(tmp_path / "out"), "--only", "extra"]) == 0
    assert (tmp_path / "out" / "extra" / "config.json").is_file()


def test_main_mismatch_is_exit_code_1(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(dm, "hf_fetch", FakeHub({**FILES, "config.json": b"nope"}))
    path = write_manifest(tmp_path, manifest_dict())
    assert dm.main(["--manifest", str(path), "--output", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: size mismatch for toy/config.json: expected {len(FILES['config.json'])} bytes, got 4"]


# ---------------------------------------------------------------------------------------- hf_hub_download

def _http_error(cls, status: int):
    response = httpx.Response(status, request=httpx.Request("GET", "https://huggingface.co/owner/repo"))
    return cls(f"{status} Client Error.\nmore detail", response=response)


@pytest.mark.parametrize("exc,cls,message", [
    (hf_errors.LocalEntryNotFoundError("Cannot reach the Hub.\nlong explanation"), dm.DownloadError,
     "Cannot reach the Hub; this machine may have no network"),
    (httpx.ConnectError("[Errno -3] Temporary failure in name resolution"), dm.DownloadError,
     "ConnectError: [Errno -3] Temporary failure in name resolution; this machine may have no network"),
    (_http_error(hf_errors.GatedRepoError, 401), dm.DownloadError, "gated"),
    (_http_error(hf_errors.RepositoryNotFoundError, 404), dm.DownloadError, "repository not found"),
    (_http_error(hf_errors.RevisionNotFoundError, 404), dm.DownloadError, f"revision {COMMIT} not found"),
    (_http_error(hf_errors.RemoteEntryNotFoundError, 404), dm.RemoteFileMissing, "no such file"),
    (_http_error(hf_errors.HfHubHTTPError, 500), dm.DownloadError, "500 Client Error"),
])
def test_hf_fetch_errors_are_one_line(tmp_path, monkeypatch, exc, cls, message):
    def raises(*args, **kwargs):
        raise exc

    monkeypatch.setattr(dm.huggingface_hub, "hf_hub_download", raises)
    with pytest.raises(cls) as info:
        dm.hf_fetch("owner/repo", "config.json", COMMIT, tmp_path)
    text = str(info.value)
    assert text.startswith(f"cannot download config.json from owner/repo@{COMMIT}: ")
    assert message in text and "\n" not in text


def test_hf_fetch_passes_revision_and_local_dir(tmp_path, monkeypatch):
    seen = {}

    def fake(repo_id, filename, **kwargs):
        seen.update(kwargs, repo_id=repo_id, filename=filename)
        return str(tmp_path / filename)

    monkeypatch.setattr(dm.huggingface_hub, "hf_hub_download", fake)
    assert dm.hf_fetch("owner/repo", "config.json", COMMIT, tmp_path) == str(tmp_path / "config.json")
    assert seen == {"repo_id": "owner/repo", "filename": "config.json", "revision": COMMIT, "local_dir": tmp_path}


def test_main_network_error_is_one_line(tmp_path, capsys, monkeypatch):
    def offline(*args, **kwargs):
        raise hf_errors.LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub.")

    monkeypatch.setattr(dm.huggingface_hub, "hf_hub_download", offline)
    path = write_manifest(tmp_path, manifest_dict())
    assert dm.main(["--manifest", str(path), "--output", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot download config.json from owner/repo@")
    assert "this machine may have no network" in err[0]
