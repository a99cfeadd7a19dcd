"""A results directory that cannot be created is a one-line error before anything loads, and is not made early."""
from __future__ import annotations

import os

import pytest

from experiments.run_dirs import check_creatable, results_dir
from specter.errors import SpecterError
from tests.cli import cli_error, compose_with


def test_a_path_under_a_file_cannot_be_created(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("")
    with pytest.raises(SpecterError, match=f"^results directory {tmp_path}/file/a/b cannot be created: "
                                           f"{tmp_path}/file is not a directory$"):
        results_dir(compose_with(f"results_dir={tmp_path / 'file' / 'a' / 'b'}"))
    with pytest.raises(SpecterError, match="file/main/tiny-dsv2-high cannot be created: .*/file is not a directory"):
        results_dir(compose_with("results_root=file"))  # the default name under results_root


def test_a_path_under_proc_cannot_be_created_even_for_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert os.access("/proc", os.W_OK | os.X_OK) or os.geteuid() != 0  # why a real directory is tried instead
    with pytest.raises(SpecterError, match="^results directory /proc/forbidden cannot be created: /proc is not "
                                           "writable$"):
        results_dir(compose_with("results_dir=/proc/forbidden"))


def test_the_harness_stops_with_one_line_before_loading(tmp_path, monkeypatch):
    error = cli_error(tmp_path, monkeypatch, "results_dir=/proc/forbidden", "device=cpu")
    assert error == "results directory /proc/forbidden cannot be created: /proc is not writable"


def test_a_creatable_directory_is_not_made_by_the_check(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path, resumed = results_dir(compose_with(f"results_dir={tmp_path / 'new' / 'run'}"))
    assert path == tmp_path / "new" / "run" and not resumed
    check_creatable(tmp_path / "relative")
    assert list(tmp_path.iterdir()) == []  # neither the directory nor the probe is left
