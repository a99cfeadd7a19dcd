"""Multiruns through the submitit launchers (conf/hydra/launcher), run_all.sh --launcher, the merged summary."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from experiments.result_runs import summaries
from experiments.summarize import main as summarize_main
from experiments.summarize import merged_summary

ROOT = Path(__file__).resolve().parent.parent
TINY = ("num_prompts=1", "repeats=1", "max_new_tokens=8", "dataset=builtin", "device=cpu",
        "systems=[specter,target_only]")
DATASETS = ("gsm8k", "wikitext2", "humaneval", "gpqa", "c4")  # conf/dataset/all.yaml's members


def environment(*path: str) -> dict:
    """This interpreter's environment, offline, with `path` and then this interpreter's directory first on PATH
    (run_all.sh calls python3)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "PATH": os.pathsep.join([*path, str(Path(sys.executable).parent), os.environ.get("PATH", "")])}


def multirun(*args: str, cwd: Path, path: str | None = None) -> subprocess.CompletedProcess:
    """`python -m experiments.main -m ARGS` from `cwd`; `path` goes first on PATH."""
    env = environment(*([path] if path else []))
    return subprocess.run([sys.executable, "-m", "experiments.main", "-m", *args], cwd=cwd, capture_output=True,
                          text=True, env=env, timeout=600)


def test_local_pool_runs_each_job_into_its_own_directory_and_the_merged_summary_has_both(tmp_path):
    root, cwd = tmp_path / "results", tmp_path / "cwd"
    cwd.mkdir()
    result = multirun("hydra/launcher=local", "k=2,4", *TINY, f"results_root={root}", cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = {int(re.search(r"-k(\d+)", d.name).group(1)): d for d in (root / "main").iterdir()}
    assert set(runs) == {2, 4}
    assert sorted(d.name for d in runs.values()) == ["tiny-dsv2-high-k2", "tiny-dsv2-high-k4"]  # the parent's sweep
    for k, directory in runs.items():
        run = json.loads((directory / "run.json").read_text())
        assert run["complete"] and run["config"]["k"] == k
        assert set(pd.read_csv(directory / "records.csv").system) == {"specter", "target_only"}
    assert not any(cwd.iterdir())  # no multirun/ beside the caller: the sweep's logs go under the results root
    assert list((root / ".submitit").glob("*/*/*_log.out"))

    assert summarize_main(["--merged", str(root)]) == 0
    merged = pd.read_csv(root / "summary-merged.csv")
    assert list(merged.columns[:4]) == ["run_dir", "experiment", "model", "mem"]
    assert set(merged.run_dir) == {f"main/{d.name}" for d in runs.values()}
    assert set(merged.model) == {"tiny"} and set(merged.mem) == {"high"} and set(merged.experiment) == {"main"}
    for directory in runs.values():  # each directory's rows are its own summary, ratios included
        own = merged[merged.run_dir == f"main/{directory.name}"].drop(columns=["run_dir", "experiment", "model", "mem"])
        pd.testing.assert_frame_equal(own.reset_index(drop=True).dropna(axis=1, how="all"),
                                      pd.read_csv(directory / "summary.csv").dropna(axis=1, how="all"),
                                      check_dtype=False)
    assert summarize_main(["--merged", str(root)]) == 2  # never over an existing file


def test_slurm_preset_takes_partition_time_and_gpus_from_the_command_line(tmp_path):
    """Through the plugin to sbatch: a stand-in sbatch refuses the job, the script it was given stays."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text("#!/bin/sh\nexit 0\n")
    (fake / "sbatch").write_text("#!/bin/sh\necho 'no cluster here' >&2\nexit 1\n")
    for tool in fake.iterdir():
        tool.chmod(0o755)
    root = tmp_path / "results"
    result = multirun("hydra/launcher=slurm", "k=2,4", *TINY, f"results_root={root}", "hydra.launcher.partition=gpu",
                      "hydra.launcher.timeout_min=30", "hydra.launcher.gpus_per_node=2", cwd=tmp_path, path=str(fake))
    assert result.returncode != 0 and "no cluster here" in result.stderr
    script = "\n".join(p.read_text() for p in root.glob(".submitit/*/.submission_file_*.sh"))
    for line in ("--partition=gpu", "--time=30", "--gpus-per-node=2", "--array=0-1", "--cpus-per-task=8"):
        assert f"#SBATCH {line}" in script, line
    assert not (root / "main").exists()  # nothing ran


def run_all(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/run_all.sh", *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=environment())


def test_run_all_with_a_launcher_plans_one_job_per_model_mem_and_dataset(tmp_path):
    done = tmp_path / "main" / "tiny-qwen-low-gpqa"  # a finished job is not sent again
    done.mkdir(parents=True)
    (done / "run.json").write_text(json.dumps({"complete": True}))
    dry = run_all("--tiny", "--launcher", "slurm", "--dry-run", "--results", str(tmp_path), "--",
                  "max_new_tokens=8", "dataset=all")
    assert dry.returncode == 0, dry.stderr
    jobs = re.findall(r"\[(\w+)\] experiment=main model=(\S+) mem=(\w+) dataset=(\w+) .* -> (\S+)", dry.stdout)
    expected = {(m, mem, d) for m in ("tiny-dsv2", "tiny-qwen") for mem in ("high", "low") for d in DATASETS}
    assert {(m, mem, d) for _, m, mem, d, _ in jobs} == expected and len(jobs) == len(expected)
    assert all(path == f"{tmp_path}/main/{m}-{mem}-{d}" for _, m, mem, d, path in jobs)
    states = {(m, mem, d): state for state, m, mem, d, _ in jobs}
    assert states.pop(("tiny-qwen", "low", "gpqa")) == "done" and set(states.values()) == {"todo"}
    steps = set(re.findall(r"\] experiment=(\w+) model=(\S+) mem=(\w+)", dry.stdout))
    commands = [line for line in dry.stdout.splitlines() if "experiments.main -m hydra/launcher=slurm " in line]
    assert len(commands) == len(steps) and all("max_new_tokens=8" in c and "resume=true" in c for c in commands)
    main = {re.search(r"model=(\S+) mem=(\w+)", c).groups(): c for c in commands if "experiment=main" in c}
    assert len(main) == 4 and "systems=[specter,specter_paper,target_only," in main["tiny-dsv2", "high"]
    assert "'dataset.members=[gsm8k],[wikitext2],[humaneval],[gpqa],[c4]'" in main["tiny-dsv2", "high"]
    assert "'dataset.members=[gsm8k],[wikitext2],[humaneval],[c4]'" in main["tiny-qwen", "low"]  # gpqa: done
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["main", "run.json", "tiny-qwen-low-gpqa"]  # wrote nothing


def test_run_all_refuses_an_unknown_launcher_in_one_line():
    bad = run_all("--launcher", "bogus", "--dry-run")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("error: unknown launcher 'bogus'") and bad.stderr.count("\n") == 1


def write_case(root: Path, name: str, members: list[str], rows: str) -> None:
    directory = root / "main" / name
    directory.mkdir(parents=True)
    (directory / "summary.csv").write_text("system,dataset,tpot_median_ms,tpot_over_specter\n" + rows)
    config = {"dataset": {"name": "all", "members": members}, "model": {"name": "dsv2"}, "mem": {"name": "high"},
              "experiment": {"name": "main"}, "num_prompts": 5}
    (directory / "run.json").write_text(json.dumps({"complete": True, "config": config}))
    (directory / "records.csv").write_text("system\n")


def test_a_grids_dataset_cases_draw_as_their_model_and_memory_run(tmp_path):
    write_case(tmp_path, "dsv2-high-gsm8k", ["gsm8k"], "specter,gsm8k,10,1\nspecter,AVG,10,1\n")
    write_case(tmp_path, "dsv2-high-c4", ["c4"], "specter,c4,20,1\nspecter,AVG,20,1\n")
    write_case(tmp_path, "dsv2-low", ["gsm8k", "c4"], "specter,gsm8k,30,1\nspecter,c4,40,1\nspecter,AVG,35,1\n")
    data = summaries(tmp_path, "main")
    assert sorted(zip(data.run, data.dataset)) == [("dsv2-high", "c4"), ("dsv2-high", "gsm8k"), ("dsv2-low", "AVG"),
                                                   ("dsv2-low", "c4"), ("dsv2-low", "gsm8k")]  # a case's AVG: left out
    merged = merged_summary(tmp_path)
    assert set(merged.run_dir) == {"main/dsv2-high-gsm8k", "main/dsv2-high-c4", "main/dsv2-low"}
    assert (merged.dataset == "AVG").sum() == 3  # every directory's own rows, nothing across two
    with pytest.raises(ValueError, match="never overwritten"):
        merged_summary(tmp_path)
    assert summarize_main(["--merged", str(tmp_path), str(tmp_path)]) == 2  # one of DIRECTORY or --merged
