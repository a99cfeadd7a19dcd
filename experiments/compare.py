"""Re-run check: a re-run's median TPOT per system and dataset against a reference run's, within a tolerance.

    python -m experiments.compare results/reference/main-h200-dsv2-high-k8 results/rerun/dsv2-high
    python -m experiments.compare REF RERUN --tolerance 0.10 --metric tpot_ms

Each side is a results directory (its records.csv); the medians are over the measured cases (prompts x
repeats) of a system and dataset, and over all of a system's cases as dataset `ALL`. Only the (system,
dataset, prompt) cases that both runs measured count, so a partial run is compared like with like (a note
says how many rows that left out; --all-cases compares every case of each side). A warning names any
setup the two differ in (model, weights, memory, dtype, lengths from run.json; the K values run), and
another warns when the hosts' time per small torch op (run.json's machine.host_op_us) differs by more than
the tolerance: eagerly run systems (the baselines) follow the host's speed. Ratios between systems are only
taken within a run (experiments.records.same_run_ratios: the cases both ran in one process): each run's
"x Specter" is printed side by side with their range, never one ratio pooled over the two runs. Exit status:
0 when every pair both runs measured is within the tolerance, 1 when one is not, 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from experiments.records import read_records, same_run_ratios

TOLERANCE = 0.10  # a re-run on another H200 is expected within 10% of the published medians


def medians(records: pd.DataFrame, metric: str) -> pd.Series:
    """Median of `metric` over the measured rows, per (system, dataset) and per (system, "ALL")."""
    if metric not in records:
        raise ValueError(f"the records have no column {metric!r}")
    ok = records[records.status == "ok"].assign(value=lambda f: pd.to_numeric(f[metric], errors="coerce"))
    ok = ok[ok.value.notna()]
    per_dataset = ok.groupby(["system", "dataset"], sort=False).value.median()
    overall = ok.groupby("system", sort=False).value.median()
    overall.index = pd.MultiIndex.from_tuples([(system, "ALL") for system in overall.index])
    return pd.concat([per_dataset, overall])


CASE = ["system", "dataset", "prompt_id"]  # a case as both runs name it; repeats are pooled


def shared_cases(reference: pd.DataFrame, rerun: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The measured rows of each run whose (system, dataset, prompt) the other run measured too."""
    def keys(frame: pd.DataFrame) -> pd.Series:
        return frame[CASE].astype(str).agg("|".join, axis=1)
    reference, rerun = (frame[frame.status == "ok"] for frame in (reference, rerun))
    ref_keys, rerun_keys = keys(reference), keys(rerun)
    return reference[ref_keys.isin(set(rerun_keys))], rerun[rerun_keys.isin(set(ref_keys))]


def compare(reference: pd.Series, rerun: pd.Series, tolerance: float = TOLERANCE) -> pd.DataFrame:
    """Rows (system, dataset, reference, rerun, ratio = rerun / reference, within) for the pairs both hold."""
    both = reference.index.intersection(rerun.index, sort=False)
    table = pd.DataFrame({"reference": reference[both], "rerun": rerun[both]})
    table["ratio"] = table.rerun / table.reference
    table["within"] = (table.ratio - 1).abs() <= tolerance
    return table.rename_axis(["system", "dataset"]).reset_index()


def ratios_by_run(runs: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Per system: each run's median TPOT over Specter's within that run (name -> records), and their range."""
    columns = {}
    for name, frame in runs.items():
        ok = frame[frame.status == "ok"]
        if "specter" in set(ok.system):
            columns[name] = same_run_ratios(ok.assign(tpot_ms=pd.to_numeric(ok.tpot_ms, errors="coerce")), ["system"])
    table = pd.DataFrame(columns)
    if table.empty:
        return table
    table["range"] = [f"{row.min():.2f}-{row.max():.2f}x" if row.notna().any() else "-"
                      for _, row in table.iterrows()]
    return table.rename_axis("system").reset_index()


SETUP = ("model.name", "model.weights", "mem.name", "dtype", "max_new_tokens", "prefix_tokens")  # what must agree


def load(directory: Path, metric: str) -> tuple[pd.DataFrame, dict, float | None]:
    """The run's records, its setup (SETUP keys from run.json where it has one, and the K values run) and its
    host's us per small torch op (run.json's machine.host_op_us; None where it has none)."""
    records = directory / "records.csv"
    if not records.is_file():
        raise ValueError(f"{directory} is not a results directory (it has no records.csv)")
    frame = read_records(records)
    if medians(frame, metric).empty:
        raise ValueError(f"{records} holds no measured {metric}")
    setup = {"k": sorted({str(k) for k in frame[frame.status == "ok"].get("k", [])})}
    run, host_op_us = directory / "run.json", None
    if run.is_file():
        info = json.loads(run.read_text())
        config = info.get("config", {})
        host_op_us = (info.get("machine") or {}).get("host_op_us")
        for key in SETUP:
            value = config
            for part in key.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            setup[key] = value
    return frame, setup, host_op_us


def setup_differences(reference: dict, rerun: dict) -> list[str]:
    """`key: reference -> rerun` for each setup value both runs record and that differs."""
    return [f"{key}: {reference[key]} -> {rerun[key]}" for key in reference
            if key in rerun and reference[key] != rerun[key]]


def host_difference(before: float | None, after: float | None, tolerance: float) -> str | None:
    """A warning when both runs record the host's us per small torch op and they differ beyond `tolerance`."""
    if not before or not after or abs(after / before - 1) <= tolerance:
        return None
    return (f"warning: the hosts differ in speed (host_op_us {before} -> {after}, {after / before:.2f}x): "
            f"systems that run eagerly, one token per forward (the baselines), follow the host")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reference", type=Path)
    parser.add_argument("rerun", type=Path)
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help="largest |rerun / reference - 1|")
    parser.add_argument("--metric", default="tpot_ms")
    parser.add_argument("--all-cases", action="store_true",
                        help="compare every case of each run, not only the (system, dataset, prompt) cases both measured")
    args = parser.parse_args(argv)
    try:
        if not args.tolerance >= 0:
            raise ValueError(f"--tolerance must be a number >= 0, got {args.tolerance}")
        (reference, reference_setup, reference_host), (rerun, rerun_setup, rerun_host) = (
            load(args.reference, args.metric), load(args.rerun, args.metric))
        dropped = ""
        if not args.all_cases:
            measured = sum(int((frame.status == "ok").sum()) for frame in (reference, rerun))
            reference, rerun = shared_cases(reference, rerun)
            left_out = measured - len(reference) - len(rerun)
            dropped = (f"note: {left_out} measured rows are cases only one run has; compared over the "
                       f"(system, dataset, prompt) cases both measured (--all-cases: every case)") if left_out else ""
        table = compare(medians(reference, args.metric), medians(rerun, args.metric), args.tolerance)
        if table.empty:
            raise ValueError("the two runs share no (system, dataset) with a measured value")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if dropped:
        print(dropped, file=sys.stderr)
    differences = setup_differences(reference_setup, rerun_setup)
    if differences:
        print(f"warning: the runs differ in setup ({'; '.join(differences)}): not a re-run of the same case",
              file=sys.stderr)
    host = host_difference(reference_host, rerun_host, args.tolerance)
    if host:
        print(host, file=sys.stderr)
    print(table.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    ratios = ratios_by_run({"reference": reference, "rerun": rerun})
    if not ratios.empty:
        print("x Specter within each run (TPOT / Specter's on the cases both ran in one process; not pooled):")
        print(ratios.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    outside = table[~table.within]
    print(f"{len(table) - len(outside)} of {len(table)} medians within {args.tolerance:.0%} of the reference"
          + ("" if outside.empty else "; outside: " + ", ".join(f"{r.system}/{r.dataset} ({r.ratio:.2f}x)"
                                                               for r in outside.itertuples())))
    return 0 if outside.empty else 1


if __name__ == "__main__":
    sys.exit(main())
