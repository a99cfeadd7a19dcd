"""Provenance: the commit comes from the project's own repository or $SPECTER_COMMIT, never from a repository
the project was copied into."""
import json
import subprocess

import pytest

from experiments import provenance


def make_repo(path):
    path.mkdir(parents=True, exist_ok=True)
    for args in (["init", "-q"], ["-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "--allow-empty",
                                  "-m", "outer"]):
        subprocess.run(["git", *args], cwd=path, check=True, capture_output=True)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True).stdout.strip()


def test_a_copy_inside_another_repository_records_an_unknown_commit(tmp_path, monkeypatch):
    monkeypatch.delenv(provenance.COMMIT_VARIABLE, raising=False)
    outer = make_repo(tmp_path / "outer")
    copy = tmp_path / "outer" / "specter-copy"
    copy.mkdir()
    assert provenance.commit(copy) is None and provenance.dirty(copy) is None  # not the outer repository's
    assert provenance.commit(tmp_path / "outer") == outer and provenance.dirty(tmp_path / "outer") is False
    assert provenance.commit(tmp_path) is None  # no repository at all


def test_the_documented_variable_names_the_commit_of_a_copy_without_git(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTER_COMMIT", "feed123")
    assert provenance.commit(tmp_path) == "feed123" and provenance.dirty(tmp_path) is None


@pytest.mark.slow
def test_run_json_takes_its_commit_from_the_variable(tmp_path, monkeypatch):
    from experiments.main import run
    from tests.cli import compose_with
    monkeypatch.setenv("SPECTER_COMMIT", "feed123")
    monkeypatch.chdir(tmp_path)
    out = run(compose_with("systems=[specter]", "num_prompts=1", "repeats=1", "max_new_tokens=4", "device=cpu",
                           f"results_root={tmp_path}"))
    info = json.loads((out / "run.json").read_text())
    assert info["git_commit"] == "feed123" and info["git_dirty"] is None
    assert info["invocations"][0]["git_commit"] == "feed123"
