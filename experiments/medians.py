"""Per-system medians of a results directory, the numbers the reference NOTES tables quote.

    python -m experiments.medians results/reference/calibrated-h200/issue21-s26-dsv2-low-k32

Over every measured case of a system (datasets x prompts x repeats): median TPOT with its min and max, the
draft, verify and wait phases per committed token, PCIe GB per committed token while decoding and the I/O
floor at the run's one bandwidth (experiments.records' definitions), the mean accepted length, how many cases
gave the resident target's tokens, and the TPOT ratios to Specter and to MO-SM on the cases both ran in the
same process (how many times faster than MO-SM a system is). Exit status 2 on a missing or empty directory.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from experiments.records import read_records, same_run_ratios, token_summary

PER_TOKEN = ("draft_ms", "verify_ms", "wait_ms")  # per run, divided by its generated tokens


def system_medians(records: pd.DataFrame) -> pd.DataFrame:
    """One row per system (in first-seen order) of the measured rows' medians."""
    ok = records[records.status == "ok"]
    rows = []
    for system, runs in ok.groupby("system", sort=False):
        num = runs.apply(pd.to_numeric, errors="coerce")  # "-" and text columns become NaN
        tpot = num.tpot_ms
        row = {"system": system, "cases": len(runs), "tpot_ms": tpot.median(),
               "tpot_min_ms": tpot.min(), "tpot_max_ms": tpot.max()}
        for key in PER_TOKEN:
            row[f"{key.removesuffix('_ms')}_ms_per_token"] = (column(num, key) / num.generated_tokens).median()
        row["gb_per_token"] = column(num, "decode_h2d_bytes_per_token").median() / 1e9
        row["io_floor_ms"] = column(num, "io_floor_ms").median()
        row["mean_accepted_length"] = column(num, "mean_accepted_length").median()
        row["tokens_match_target"] = int(column(runs, "tokens_match_target").astype(str).str.lower()
                                         .isin(("true", "1", "yes")).sum())
        row["token_check"] = token_summary(runs)
        rows.append(row)
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    numeric = ok.assign(tpot_ms=pd.to_numeric(ok.tpot_ms, errors="coerce"))
    if "specter" in set(table.system):
        table["x_specter"] = table.system.map(same_run_ratios(numeric, ["system"], "specter"))
    if "mo_sm" in set(table.system):
        table["mo_sm_over_it"] = 1 / table.system.map(same_run_ratios(numeric, ["system"], "mo_sm"))
    return table


def column(frame: pd.DataFrame, name: str) -> pd.Series:
    """`frame[name]`, or NaN where the records predate that column."""
    return frame[name] if name in frame else pd.Series(float("nan"), index=frame.index)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a results directory (with records.csv)")
    args = parser.parse_args(argv)
    path = args.run / "records.csv"
    if not path.is_file():
        print(f"error: no records.csv in {args.run}", file=sys.stderr)
        return 2
    table = system_medians(read_records(path))
    if table.empty:
        print(f"error: {path} has no measured rows", file=sys.stderr)
        return 2
    with pd.option_context("display.width", 200, "display.max_columns", None):
        print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
