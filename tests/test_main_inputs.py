"""The harness's command line does what it is asked or says why not: systems, unknown keys, resume, sweeps, help."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from experiments.main import system_overrides
from experiments.run_dirs import results_dir, swept_keys
from specter.errors import SpecterError
from tests.cli import cli_error, compose_with

ROOT = Path(__file__).resolve().parent.parent
SMALL = ("num_prompts=1", "repeats=1", "max_new_tokens=6", "warmup_tokens=2", "device=cpu")


def run_main(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "experiments.main", *args], cwd=cwd, capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.mark.parametrize("arg", ["system=specter_no_prefetch", "+system=specter_no_prefetch"])
def test_system_x_runs_system_x(arg):
    assert system_overrides([arg, "k=2"]) == ["systems=[specter_no_prefetch]", "k=2"]


@pytest.mark.parametrize("args,message", [
    (["system=nope"], "unknown system 'nope'; known: "),
    (["+system=nope"], "unknown system 'nope'"),
    (["~system"], "unknown system ''"),
    (["system=specter", "systems=[specter,target_only]"], "give one system=X"),
])
def test_a_wrong_system_choice_is_one_line(args, message):
    with pytest.raises(SpecterError, match=message) as err:
        system_overrides(args)
    assert "\n" not in str(err.value)


def test_the_chosen_system_is_what_runs(tmp_path):
    out = tmp_path / "r"
    result = run_main("system=specter_no_prefetch", f"results_dir={out}", *SMALL, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert set(pd.read_csv(out / "records.csv").system) == {"specter_no_prefetch"}


@pytest.mark.parametrize("arg", ["+foo=1", "+systemz=[specter]"])
def test_a_key_no_code_reads_is_an_error_before_the_run(tmp_path, monkeypatch, arg):
    error = cli_error(tmp_path, monkeypatch, arg, f"results_dir={tmp_path / 'r'}")
    assert f"unknown option {arg[1:].partition('=')[0]}=" in error and "\n" not in error
    assert not (tmp_path / "r").exists()


def test_resume_into_a_missing_directory_says_there_is_nothing_to_resume(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for extra in ([], [f"results_dir={tmp_path / 'none'}"]):
        with pytest.raises(SpecterError, match="nothing to resume: .* does not exist"):
            results_dir(compose_with("resume=true", *extra))
    assert not (tmp_path / "none").exists() and not (tmp_path / "results").exists()


def test_resuming_a_finished_run_has_nothing_to_do_and_prints_the_summary(tmp_path):
    out = tmp_path / "r"
    first = run_main(f"results_dir={out}", *SMALL, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    before = (out / "records.csv").read_bytes()
    again = run_main(f"results_dir={out}", "resume=true", *SMALL, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("nothing to do:") and "specter" in again.stdout and "TPOT ms" in again.stdout
    assert "decoding" not in again.stderr and (out / "records.csv").read_bytes() == before
    assert json.loads((out / "run.json").read_text())["complete"] is True


def test_a_multirun_names_each_directory_by_its_swept_overrides(tmp_path):
    result = run_main("-m", "k=2,3", *SMALL, "systems=[specter]", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in (tmp_path / "results" / "main").iterdir())
    assert names == ["tiny-dsv2-high-k2", "tiny-dsv2-high-k3"]
    for name, k in zip(names, (2, 3)):
        assert set(pd.read_csv(tmp_path / "results" / "main" / name / "records.csv").k) == {k}


def test_swept_keys_are_those_with_several_values():
    assert swept_keys(["k=2,8", "systems=[specter,target_only]", "repeats=1", "+seed=range(0,3)", "-m"]) == {"k", "seed"}


def test_help_lists_systems_models_memory_experiments_and_the_common_options(tmp_path):
    result = run_main("--help", cwd=tmp_path)
    assert result.returncode == 0 and not result.stderr
    text = result.stdout
    for heading in ("systems (system=X", "models (model=)", "memory (mem=)", "experiments (experiment=)",
                    "common options:"):
        assert heading in text
    for name in ("specter ", "target_only", "mo_sm", "tiny-qwen", "dsv2", "low", "high", "depth", "batch"):
        assert f"\n  {name}" in text
    common = text.split("common options:\n")[1].split("\n\n")[0].splitlines()
    assert len(common) == 10 and all(len(line.split("  ", 2)) >= 2 for line in common)
    assert "_target_" not in text and "Hydra" in text and not (tmp_path / "results").exists()


def test_a_sweep_over_a_group_checks_each_option(tmp_path, monkeypatch):
    from experiments.main import check_group_choices

    check_group_choices(["-m", "dataset=gsm8k,humaneval", "mem=high,low", "model=choice(tiny,dsv2)"])
    with pytest.raises(SpecterError, match="unknown dataset 'nope'"):
        check_group_choices(["dataset=gsm8k,nope"])


def test_a_launchers_job_names_its_directory_by_the_parents_sweep(monkeypatch):
    from experiments import run_dirs

    monkeypatch.setenv(run_dirs.SWEPT_KEYS_VARIABLE, "k")
    assert run_dirs.swept_from_environment() == {"k"}
    monkeypatch.setenv(run_dirs.SWEPT_KEYS_VARIABLE, "")
    assert run_dirs.swept_from_environment() == set()  # no sweep said: the job's own command line decides
