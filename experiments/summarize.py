"""Summary of a results directory from its records alone (a run cut short by a time limit has no summary.csv).

    python -m experiments.summarize results/batch/dsv2-high          # writes summary.csv there, prints it
    python -m experiments.summarize DIR --by-host     # per system and host (run.json's invocations): summary-by-host.csv
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from experiments.records import SUMMARY_KEYS, format_table, read_records, summarize


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--output", type=Path, default=None, help="where to write (default DIR/summary.csv)")
    parser.add_argument("--by-host", action="store_true",
                        help="per system and host (host_op_us of the invocation that wrote each row)")
    args = parser.parse_args(argv)
    try:
        summary = summarize_dir(args.directory, args.output, args.by_host)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
