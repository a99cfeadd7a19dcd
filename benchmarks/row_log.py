"""A benchmark's CSV written row by row as measured, each row with the commit, the host and the workload."""
from __future__ import annotations

import csv
import socket
from pathlib import Path

from experiments import provenance

ROOT = Path(__file__).resolve().parent.parent
PROVENANCE = ("commit", "host", "workload")


def commit() -> str:
    """The checkout's short commit, `-dirty` when tracked files differ from it; $SPECTER_COMMIT where it is set
    (a copy without .git, e.g. a GPU machine's), else "unknown" (experiments.provenance)."""
    name = provenance.commit(ROOT, short=True)
    return "unknown" if name is None else f"{name}-dirty" if provenance.dirty(ROOT) else name


def host() -> str:
    """The machine's name, and its GPU's where torch sees one."""
    name = socket.gethostname()
    try:
        import torch
        if torch.cuda.is_available():
            name += f" ({torch.cuda.get_device_name()})"
    except ImportError:
        pass
    return name


class RowLog:
    """Rows appended to `path` as they come (a crash keeps those written), after the columns commit, host and
    workload; a row with a column the file lacks rewrites the file with it (a row without one leaves it empty)."""

    def __init__(self, path: Path, commit_id: str | None = None, host_name: str | None = None) -> None:
        self.path = Path(path)
        self.stamp = {"commit": commit_id or commit(), "host": host_name or host()}
        self.rows: list[dict] = []
        self.columns: list[str] = []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")

    def add(self, row: dict, workload: str) -> dict:
        """`row` with this log's commit and host and `workload`, written; returns the row as written."""
        row = {**self.stamp, "workload": workload, **{k: v for k, v in row.items() if k not in PROVENANCE}}
        self.rows.append(row)
        new = [key for key in row if key not in self.columns]
        if new:
            self.columns += new
            with self.path.open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=self.columns)
                writer.writeheader()
                writer.writerows(self.rows)
        else:
            with self.path.open("a", newline="") as f:
                csv.DictWriter(f, fieldnames=self.columns).writerow(row)
        return row
