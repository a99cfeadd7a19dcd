"""Summary of a results directory from its records alone (a run cut short by a time limit has no summary.csv).

    python -m experiments.summarize results/batch/dsv2-high          # writes summary.csv there, prints it
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from experiments.records import SUMMARY_KEYS, format_table, read_records, summarize


def summarize_dir(directory: Path, output: Path | None = None) -> pd.DataFrame:
    """Summarize `directory`/records.csv as its experiment does; write it to `output` (default
    summary.csv there), never over an existing file."""
    records, run = directory / "records.csv", directory / "run.json"
    if not records.is_file() or not run.is_file():
        raise ValueError(f"{directory} is not a results directory (it needs records.csv and run.json)")
    try:
        experiment = json.loads(run.read_text())["config"]["experiment"]["name"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{run} is not a run.json written by experiments.main ({err})") from err
    if experiment not in SUMMARY_KEYS:
        raise ValueError(f"{run} names an unknown experiment {experiment!r}")
    output = output or directory / "summary.csv"
    if output.exists():
        raise ValueError(f"{output} already exists; it is never overwritten: pass --output PATH")
    rows = read_records(records)
    if rows.empty:
        raise ValueError(f"{records} holds no records yet")
    summary = summarize(rows, SUMMARY_KEYS[experiment])
    summary.to_csv(output, index=False)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--output", type=Path, default=None, help="where to write (default DIR/summary.csv)")
    args = parser.parse_args(argv)
    try:
        summary = summarize_dir(args.directory, args.output)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
