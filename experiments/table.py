"""The results table of record: one block per (model, memory) run, every ratio taken within that run.

    python -m experiments.table results/reference/table-h200              # Markdown on stdout
    python -m experiments.table ROOT --out table.md                       # never over an existing file
    python -m experiments.table --readme README.md                        # regenerate the README's table

For every main-experiment directory under ROOT (records.csv and run.json), one block: its setup line (model,
weights, memory, K, cases, datasets, GPU, commit, the run's H2D bandwidth), then per system over all its
measured cases the median TPOT, its TPOT over Specter's on the cases both ran in one process, decoding's H2D
MB per committed token, its I/O floor (those bytes at the run's bandwidth) and TPOT over it, and how many
cases gave the resident target's tokens; under it, each Specter's TPOT over the lowest peer floor. A system
that could not run is listed with its reason. `--readme FILE` rewrites the block between FILE's
`<!-- results-table: ROOT -->` and `<!-- /results-table -->` lines with ROOT's table (ROOT relative to FILE's
folder). Exit status 2 on bad input.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pandas as pd

from experiments.medians import system_medians
from experiments.records import beats_link, rate_over_link, read_records
from experiments.result_runs import run_config
from experiments.summarize import results_dirs

README_BLOCK = re.compile(r"(<!-- results-table: (?P<root>\S+) -->\n)(?P<table>.*?)(<!-- /results-table -->)", re.S)
COLUMNS = {"tpot_ms": "TPOT ms", "x_specter": "x Specter", "mb_per_token": "MB/token", "io_floor_ms": "floor ms",
           "x_floor": "x floor", "tokens": "target's tokens"}


def run_block(directory: Path) -> str:
    """One run's setup line, its systems' table and the peer-floor lines (Markdown)."""
    info = run_config(directory)
    records = read_records(directory / "records.csv")
    table = system_medians(records)
    if table.empty:
        return f"### {directory.name}\n\nno measured rows\n"
    table["mb_per_token"] = table.gb_per_token * 1e3
    table["x_floor"] = table.tpot_ms / table.io_floor_ms
    table["tokens"] = [row.token_check or "-" if row.system != "target_only" else "(reference)"
                       for row in table.itertuples()]
    lines = [f"### {setup_line(info, records)}", "", markdown(table)]
    lines += [f"- {line}" for line in link_lines(records) or peer_floor_lines(table)]
    missing = records[records.status != "ok"].drop_duplicates("system")
    lines += [f"- {row.system}: {row.status}" for row in missing.itertuples() if row.system not in set(table.system)]
    return "\n".join(lines) + "\n"


def setup_line(info: dict, records: pd.DataFrame) -> str:
    """`dsv2 (calibrated), mem=low, K=32: 18 cases (gsm8k, humaneval), NVIDIA H200, commit abc1234, 53.1 GB/s`."""
    config = info.get("config") or {}
    model, mem = config.get("model") or {}, config.get("mem") or {}
    ok = records[records.status == "ok"]
    ks = ", ".join(sorted({str(k) for k in ok.get("k", [])})) or "-"
    datasets = ", ".join(dict.fromkeys(ok.dataset.astype(str))) if "dataset" in ok else "-"
    gbps, repeats = info.get("h2d_gbps"), config.get("repeats")
    return (f"{model.get('label') or model.get('name')} ({model.get('weights')}), mem={mem.get('name')}, K={ks}: "
            f"{len(ok)} decodes ({datasets}; {repeats} repeat{'' if repeats == 1 else 's'}), {info.get('gpu') or 'CPU'}, "
            f"commit {str(info.get('git_commit'))[:7]}, H2D {f'{gbps} GB/s' if gbps else 'not measured (no GPU)'}")


def link_lines(records: pd.DataFrame) -> list[str]:
    """A warning where a system's decode moved data faster than the run's measured link (its floors are then too
    low to compare against); [] otherwise, and for runs from before the link's rate was recorded per row."""
    ok = records[records.status == "ok"]
    if "link_gbps" not in ok or pd.to_numeric(ok.link_gbps, errors="coerce").isna().all():
        return []
    ok = ok.assign(**{c: pd.to_numeric(ok[c], errors="coerce")
                      for c in ("link_gbps", "h2d_gbps", "decode_h2d_bytes_per_token", "tpot_ms")})
    over = rate_over_link(ok)
    if not beats_link(over).any():
        return []
    worst = ok.loc[over.idxmax()]
    return [f"warning: {worst.system} moved data {over.max():.2f}x faster than the measured link rate: the floors "
            f"are not trustworthy"]


def peer_floor_lines(table: pd.DataFrame) -> list[str]:
    """Each Specter's TPOT over the lowest I/O floor among the run's other systems."""
    peers = table[~table.system.str.startswith("specter") & table.io_floor_ms.notna()]
    if peers.empty:
        return []
    lowest = peers.loc[peers.io_floor_ms.idxmin()]
    return [f"{row.system}: TPOT {row.tpot_ms / lowest.io_floor_ms:.2f}x {lowest.system}'s I/O floor "
            f"({lowest.io_floor_ms:.2f} ms), the lowest among the other systems"
            for row in table[table.system.str.startswith("specter")].itertuples()]


def markdown(table: pd.DataFrame) -> str:
    cells = [["system", *COLUMNS.values()], ["---"] * (len(COLUMNS) + 1)]
    for row in table.to_dict("records"):
        cells.append([row["system"], *(cell(row.get(key)) for key in COLUMNS)])
    return "\n".join("| " + " | ".join(line) + " |" for line in cells)


def cell(value) -> str:
    if isinstance(value, float):
        return "-" if value != value else (f"{value:.1f}" if abs(value) >= 100 else f"{value:.2f}")
    return "-" if value is None else str(value)


def render(root: Path) -> str:
    """Every main run under `root`, one block each (in path order)."""
    runs = [d for d in results_dirs(root)
            if ((run_config(d).get("config") or {}).get("experiment") or {}).get("name") == "main"]
    if not runs:
        raise ValueError(f"no main-experiment results directory under {root}")
    head = ("Per run: medians over every measured decode; x Specter: TPOT over Specter's on the cases both decoded in "
            "that run; MB/token: H2D bytes per committed token while decoding; floor: those bytes at the run's H2D "
            "bandwidth; x floor: TPOT over it.\n")
    return "\n".join([head, *(run_block(d) for d in runs)])


def readme_with_table(text: str, base: Path) -> str:
    """`text` with its results-table block rendered afresh from the block's root (relative to `base`)."""
    found = README_BLOCK.search(text)
    if found is None:
        raise ValueError("no '<!-- results-table: ROOT -->' ... '<!-- /results-table -->' block")
    root = base / found["root"]
    if not root.is_dir():
        raise ValueError(f"the results-table block names {found['root']}, which is not a directory")
    return text[:found.start("table")] + render(root) + "\n" + text[found.end("table"):]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, nargs="?")
    parser.add_argument("--out", type=Path, default=None, help="write the Markdown here (never over a file)")
    parser.add_argument("--readme", type=Path, default=None, help="rewrite this file's results-table block")
    args = parser.parse_args(argv)
    try:
        if args.readme is not None:
            args.readme.write_text(readme_with_table(args.readme.read_text(), args.readme.parent))
            return 0
        if args.root is None:
            raise ValueError("give a results root (or --readme FILE)")
        if not args.root.is_dir():
            raise ValueError(f"{args.root} is not a directory")
        if args.out is not None and args.out.exists():
            raise ValueError(f"{args.out} already exists; it is never overwritten")
        text = render(args.root)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.out is not None:
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
