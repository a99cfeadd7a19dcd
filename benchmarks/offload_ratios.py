"""Each Specter variant's TPOT over Specter's, run by run, from bench_offload.py's CSVs (CPU: reads files only).

    python benchmarks/offload_ratios.py results/reference/calibrated-h200/issue21-s3*/*.csv [--mem low]

A bench_offload CSV holds one process's rows: a variant is compared with the `specter` row of the same file,
model, memory setting and K (a K sweep's `specter_k<K>` rows likewise); `specter_paper` is the variant `paper`
(the paper's design over Specter's default). Prints a line per variant and file
(TPOT, Specter's, the ratio, the TPOT spread, whether its tokens matched the resident target's), then per
variant, model and memory setting the ratio's median, min and max over the files: how a goal such as issue
21's "at most 0.6x Specter" holds from host to host.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path


def read_rows(path: Path) -> list[dict]:
    """The rows of one bench_offload CSV; a clear error for a file without its columns."""
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    if not rows or not {"system", "tpot_ms", "model", "mem"} <= rows[0].keys():
        raise ValueError(f"{path}: not a bench_offload CSV (needs system, tpot_ms, model and mem columns)")
    return rows


def ratios(path: Path, rows: list[dict]) -> list[dict]:
    """A record per variant row of one file: its TPOT over its Specter's, with the file and the spread."""
    specter = {(r["model"], r["mem"], r.get("k"), _k_suffix(r["system"])): r for r in rows
               if r["system"] == "specter" or r["system"].startswith("specter_k")}
    out = []
    for row in rows:
        name = row["system"]
        if not name.startswith("specter_") or name.startswith("specter_k") or "no_prefetch" in name \
                or name == "specter_eager_draft":
            continue
        base = specter.get((row["model"], row["mem"], row.get("k"), _k_suffix(name)))
        if base is None:
            continue
        tpot, base_tpot = float(row["tpot_ms"]), float(base["tpot_ms"])
        out.append({"file": str(path), "model": row["model"], "mem": row["mem"], "k": row.get("k"),
                    "variant": name.removeprefix("specter_"), "tpot_ms": tpot, "specter_tpot_ms": base_tpot,
                    "ratio": tpot / base_tpot, "spread": _spread(row),
                    "tokens_match": row.get("tokens_match_resident")})
    return out


def _spread(row: dict) -> str:
    """`min-max` TPOT of the row's decodes (2 decimals), or '?' where the CSV has no such columns."""
    try:
        return f"{float(row['tpot_min_ms']):.2f}-{float(row['tpot_max_ms']):.2f}"
    except (KeyError, TypeError, ValueError):
        return "?"


def _k_suffix(system: str) -> str:
    """`_k<K>` at the end of a K sweep's system name, else ''."""
    tail = system.rsplit("_k", 1)
    return f"_k{tail[1]}" if len(tail) == 2 and tail[1].isdigit() else ""


def summary(records: list[dict]) -> list[dict]:
    """Per (variant, model, mem): how many files, the ratio's median, min and max."""
    groups: dict = {}
    for r in records:
        groups.setdefault((r["variant"], r["model"], r["mem"]), []).append(r["ratio"])
    return [{"variant": v, "model": m, "mem": mem, "runs": len(rs), "median": statistics.median(rs),
             "min": min(rs), "max": max(rs)} for (v, m, mem), rs in sorted(groups.items())]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csvs", nargs="+", type=Path)
    parser.add_argument("--mem", help="only this memory setting (e.g. low)")
    args = parser.parse_args(argv)
    records = []
    for path in args.csvs:
        if not path.is_file():
            sys.exit(f"error: no such file: {path}")
        try:
            records += [r for r in ratios(path, read_rows(path)) if args.mem in (None, r["mem"])]
        except ValueError as err:
            sys.exit(f"error: {err}")
    if not records:
        sys.exit("error: no variant with a Specter row beside it in these files")
    for r in records:
        print(f"{r['file']}: {r['model']} {r['mem']} K={r['k']} {r['variant']}: {r['tpot_ms']:.2f} ms "
              f"({r['spread']}) vs Specter {r['specter_tpot_ms']:.2f} ms = {r['ratio']:.3f}x; tokens match "
              f"{r['tokens_match']}")
    for s in summary(records):
        print(f"{s['variant']} on {s['model']} {s['mem']}: median {s['median']:.3f}x Specter over {s['runs']} "
              f"run(s) (min {s['min']:.3f}, max {s['max']:.3f})")


if __name__ == "__main__":
    main()
