"""Which result directories the figures draw (the newest complete run per run name) and their tables."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pandas as pd

from experiments.records import SUMMARY_KEYS, read_records, summarize

REPEAT_SUFFIX = re.compile(r"\.\d+$")  # results/main/tiny-dsv2-high.1: a repeat of the run name tiny-dsv2-high


def run_config(directory: Path) -> dict:
    """The run.json of a results directory ({} when missing or unreadable)."""
    try:
        run = json.loads((directory / "run.json").read_text())
    except (OSError, ValueError):
        return {}
    return run if isinstance(run, dict) else {}


def started(directory: Path) -> float:
    """When the run last wrote its run.json (0 without one)."""
    return (directory / "run.json").stat().st_mtime if (directory / "run.json").exists() else 0.0


def chosen_runs(root: Path, experiment: str, name: str) -> list[Path]:
    """Per run name (<model>-<mem>, a `.N` suffix stripped) the newest complete run directory that has
    `name` (or, for summary.csv, records to summarize); the newest incomplete one if none finished.
    Prints which it draws and which it skips."""
    groups: dict[str, list[Path]] = {}
    for directory in sorted(p for p in (root / experiment).glob("*") if p.is_dir()):
        if (directory / name).is_file() or (name == "summary.csv" and (directory / "records.csv").is_file()):
            groups.setdefault(REPEAT_SUFFIX.sub("", directory.name), []).append(directory)
    chosen = []
    for base, dirs in groups.items():
        best = max(dirs, key=lambda d: (bool(run_config(d).get("complete")), started(d)))
        chosen.append(best)
        skipped = [d.name for d in dirs if d != best]
        state = "complete" if run_config(best).get("complete") else "incomplete: the newest of unfinished runs"
        print(f"figures: {experiment}/{base}: drawing {best.name} ({state})"
              + (f"; skipped {', '.join(skipped)}" if skipped else ""), file=sys.stderr)
    return chosen


def run_table(directory: Path, experiment: str, name: str) -> pd.DataFrame:
    """`name` of one run; a run cut short before its summary.csv is summarized from its records."""
    if (directory / name).is_file():
        return pd.read_csv(directory / name)
    return summarize(read_records(directory / "records.csv"), SUMMARY_KEYS.get(experiment, ("system", "dataset")))


def case_dataset(directory: Path) -> str | None:
    """The one dataset a run measured (dataset=X, or dataset=all cut to one member); None for several."""
    dataset = (run_config(directory).get("config") or {}).get("dataset")
    if not isinstance(dataset, dict):
        return None
    members = dataset.get("members")
    if not members:
        return dataset.get("name")
    return str(members[0]) if len(members) == 1 else None


def run_label(directory: Path) -> tuple[str, bool]:
    """(the run name a directory draws under, whether it is one dataset's case of a grid): the directory name
    without its repeat suffix (.N), and without the `-<dataset>` (or a sweep's `-dataset<dataset>`) that names
    a one-dataset case (scripts/run_all.sh --launcher: <model>-<mem>-<dataset>), so a grid's datasets share
    their model and memory setting's panel."""
    name, dataset = REPEAT_SUFFIX.sub("", directory.name), case_dataset(directory)
    for suffix in (f"-{dataset}", f"-dataset{dataset}"):
        if dataset and name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)], True
    return name, False


def summaries(root: Path, experiment: str, name: str = "summary.csv") -> pd.DataFrame:
    """The chosen runs' tables, concatenated, with `run` (the run name: `run_label`) and `num_prompts` (from
    run.json). A one-dataset case's AVG row (that dataset again) is left out."""
    frames = []
    for directory in chosen_runs(root, experiment, name):
        frame = run_table(directory, experiment, name)
        frame["run"], case = run_label(directory)
        if case and "dataset" in frame:
            frame = frame[frame.dataset != "AVG"].copy()
        frame["num_prompts"] = (run_config(directory).get("config") or {}).get("num_prompts")
        frames.append(frame)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def measured(root: Path, experiment: str) -> pd.DataFrame:
    """An experiment's summary rows that hold numbers (not 'unavailable' reasons); `tpot_ms` is the median TPOT
    (a summary written before medians has only its mean there)."""
    data = summaries(root, experiment)
    if "tpot_median_ms" in data:
        data = data.assign(tpot_ms=data.tpot_median_ms)
    return data[data.status.isna()] if "status" in data else data
