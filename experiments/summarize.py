"""Summary of a results directory from its records alone (a run cut short by a time limit has no summary.csv).

    python -m experiments.summarize results/batch/dsv2-high          # writes summary.csv there, prints it
    python -m experiments.summarize DIR --by-host     # per system and host (run.json's invocations): summary-by-host.csv
    python -m experiments.summarize --merged results/paper   # every results directory under it: summary-merged.csv
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from experiments.records import SUMMARY_KEYS, format_table, read_records, summarize
from experiments.result_runs import run_config, run_table

MERGED_KEYS = ("run_dir", "experiment", "model", "mem")  # the merged summary's first columns: whose rows they are


def summarize_dir(directory: Path, output: Path | None = None, by_host: bool = False) -> pd.DataFrame:
    """Summarize `directory`/records.csv as its experiment does, or with `by_host` per system and the host
    (host_op_us) of the invocation that wrote each row; write it to `output` (default summary.csv, or
    summary-by-host.csv, there), never over an existing file."""
    records, run = directory / "records.csv", directory / "run.json"
    if not records.is_file() or not run.is_file():
        raise ValueError(f"{directory} is not a results directory (it needs records.csv and run.json)")
    try:
        experiment = json.loads(run.read_text())["config"]["experiment"]["name"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{run} is not a run.json written by experiments.main ({err})") from err
    if experiment not in SUMMARY_KEYS:
        raise ValueError(f"{run} names an unknown experiment {experiment!r}")
    output = output or directory / ("summary-by-host.csv" if by_host else "summary.csv")
    if output.exists():
        raise ValueError(f"{output} already exists; it is never overwritten: pass --output PATH")
    rows = read_records(records)
    if rows.empty:
        raise ValueError(f"{records} holds no records yet")
    if by_host:
        rows["host_op_us"] = row_hosts(len(rows), json.loads(run.read_text()).get("invocations") or [])
    summary = summarize(rows, ("system", "host_op_us") if by_host else SUMMARY_KEYS[experiment])
    summary.to_csv(output, index=False)
    return summary


def row_hosts(n_rows: int, invocations: list[dict]) -> list[float | None]:
    """Per records.csv row, the host_op_us of the invocation that wrote it: entry i wrote the rows from its
    first_row (None, from a run.json older than the list: row 0) up to the next entry's."""
    if not invocations:
        raise ValueError("its run.json lists no invocations (written before they were recorded): rows "
                         "cannot be attributed to hosts")
    hosts: list[float | None] = [None] * n_rows
    for call in invocations:
        for row in range(call.get("first_row") or 0, n_rows):
            hosts[row] = (call.get("machine") or {}).get("host_op_us")
    return hosts


def results_dirs(root: Path) -> list[Path]:
    """Every results directory under `root` (itself included): those holding records.csv and run.json."""
    return sorted(p.parent for p in root.rglob("records.csv") if (p.parent / "run.json").is_file())


def merged_summary(root: Path, output: Path | None = None) -> pd.DataFrame:
    """Every results directory's own summary (its summary.csv, else summarized from its records), concatenated
    with `run_dir` (its path under `root`), `experiment`, `model` and `mem` (from its run.json) first; written
    to `output` (default ROOT/summary-merged.csv), never over an existing file. Each row is one directory's:
    nothing, a ratio included, is computed across two."""
    if not root.is_dir():
        raise ValueError(f"{root} is not a directory")
    output = output or root / "summary-merged.csv"
    if output.exists():
        raise ValueError(f"{output} already exists; it is never overwritten: pass --output PATH")
    frames = [frame for directory in results_dirs(root) if not (frame := labelled_summary(root, directory)).empty]
    if not frames:
        raise ValueError(f"no results directory with records under {root} (each needs records.csv and run.json)")
    merged = pd.concat(frames, ignore_index=True)
    merged.to_csv(output, index=False)
    return merged


def labelled_summary(root: Path, directory: Path) -> pd.DataFrame:
    """One results directory's summary with the MERGED_KEYS columns first (a column of the summary's own by
    one of those names becomes summary_<name>)."""
    config = run_config(directory).get("config") or {}
    experiment = (config.get("experiment") or {}).get("name")
    model, mem = config.get("model") or {}, config.get("mem") or {}
    summary = run_table(directory, experiment, "summary.csv")
    labels = dict(zip(MERGED_KEYS, (directory.relative_to(root).as_posix(), experiment,
                                    model.get("label") or model.get("name"), mem.get("name"))))
    summary = summary.rename(columns={key: f"summary_{key}" for key in labels if key in summary})
    for position, (key, value) in enumerate(labels.items()):
        summary.insert(position, key, value)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, nargs="?")
    parser.add_argument("--merged", type=Path, metavar="ROOT", default=None,
                        help="every results directory under ROOT into ROOT/summary-merged.csv")
    parser.add_argument("--output", type=Path, default=None, help="where to write (default DIR/summary.csv)")
    parser.add_argument("--by-host", action="store_true",
                        help="per system and host (host_op_us of the invocation that wrote each row)")
    args = parser.parse_args(argv)
    try:
        if (args.directory is None) == (args.merged is None) or (args.merged and args.by_host):
            raise ValueError("give one results DIRECTORY (with or without --by-host) or --merged ROOT")
        if args.merged is not None:
            merged = merged_summary(args.merged, args.output)
            print(f"{args.output or args.merged / 'summary-merged.csv'}: {len(merged)} rows from "
                  f"{merged.run_dir.nunique()} results directories")
            return 0
        summary = summarize_dir(args.directory, args.output, args.by_host)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
