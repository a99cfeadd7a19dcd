"""Decode metrics: TPOT, TTFT, acceptance rate, accepted lengths, per-phase times."""
from __future__ import annotations

import csv
import gc
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specter.device.timeline import Timeline


def format_row(row: dict) -> str:
    """One benchmark row as `key value | key value ...` (the scripts print each row as it is measured)."""
    return " | ".join(f"{k} {v}" for k, v in row.items())


def write_rows_csv(path: Path, rows: list[dict]) -> Path:
    """Rows (dicts) to a CSV file at `path`, its folder made if missing: a column per key of any row, in the order
    they first appear; a row without a key leaves its cell empty."""
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


@contextmanager
def gc_paused():
    """A timed decode without cyclic garbage collection: collect first, pause, restore the previous state.

    A full collection walks every live Python object (hundreds of thousands once a model is loaded) and
    would land inside a measurement at random; benchmarks wrap every system's generate() alike."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass
class GenerationResult:
    """What every system's generate() returns: the new tokens only, and a flat stats dict."""

    token_ids: list[int]
    stats: dict = field(default_factory=dict)


def h2d_split(stats: dict, prefill_bytes: int, decode_tokens: int) -> dict:
    """`stats` with the one definition of bytes per token (when it has H2D bytes): prefill_h2d_bytes (copies
    until the first token), decode_h2d_bytes (every copy after it) and decode_h2d_bytes_per_token, decoding's
    bytes over `decode_tokens`, the tokens committed after each request's first (those TPOT counts)."""
    if "h2d_bytes" in stats:
        stats["prefill_h2d_bytes"] = prefill_bytes
        stats["decode_h2d_bytes"] = stats["h2d_bytes"] - prefill_bytes
        stats["decode_h2d_bytes_per_token"] = stats["decode_h2d_bytes"] / max(decode_tokens, 1)
    return stats


def io_floor_ms(bytes_per_token: float, h2d_gbps: float | None) -> float:
    """The I/O floor per token: `bytes_per_token` at `h2d_gbps` (GB/s, pinned host to device) in ms; NaN
    without a bandwidth (no PCIe: a CPU run) or without bytes."""
    if not h2d_gbps or bytes_per_token != bytes_per_token:
        return float("nan")
    return bytes_per_token / (h2d_gbps * 1e6)


def tpot_ms(commit_times_ms: list[float]) -> float:
    """(time of last committed token - time of first) / (N - 1); NaN for fewer than 2 tokens."""
    n = len(commit_times_ms)
    return (commit_times_ms[-1] - commit_times_ms[0]) / (n - 1) if n > 1 else float("nan")


class DecodeMetrics:
    """Collects timestamps of commits and phases on a Timeline, and the outcome of each window."""

    def __init__(self, device: torch.device) -> None:
        self.timeline = Timeline(device)
        self.start = self.timeline.mark()
        self._commits: list[tuple[int, int]] = []  # (timeline mark, tokens committed)
        self._phases: dict[str, list[tuple[int, int]]] = {}
        self._open: dict[str, int] = {}
        self.windows: list[tuple[int, int]] = []  # (k drafted, n accepted)

    def commit(self, num_tokens: int) -> None:
        self._commits.append((self.timeline.mark(), num_tokens))

    def begin(self, phase: str) -> None:
        self._open[phase] = self.timeline.mark()

    def end(self, phase: str) -> None:
        self._phases.setdefault(phase, []).append((self._open.pop(phase), self.timeline.mark()))

    def phase_spans_ms(self) -> dict[str, list[tuple[float, float]]]:
        """phase -> its (begin, end) spans in ms since the first mark (reads the timeline)."""
        at = lambda mark: self.timeline.elapsed_ms(self.start, mark)  # noqa: E731
        return {phase: [(at(a), at(b)) for a, b in spans] for phase, spans in self._phases.items()}

    def decode_span_ms(self) -> tuple[float, float] | None:
        """(first commit, last commit) in ms since the first mark: the span TPOT divides (None before two)."""
        if len(self._commits) < 2:
            return None
        at = lambda mark: self.timeline.elapsed_ms(self.start, mark)  # noqa: E731
        return at(self._commits[0][0]), at(self._commits[-1][0])

    def committed_tokens(self) -> int:
        return sum(n for _, n in self._commits)

    def window(self, drafted: int, accepted: int) -> None:
        """One verify pass; a pass with nothing drafted (the last token) counts as an iteration only."""
        self.windows.append((drafted, accepted))

    def summary(self) -> dict:
        """The stats dict (reads the timeline: on a GPU the host waits here, once)."""
        elapsed = self.timeline.elapsed_ms
        per_token = [elapsed(self.start, mark) for mark, n in self._commits for _ in range(n)]
        stats = {
            "generated_tokens": len(per_token),
            "tpot_ms": tpot_ms(per_token),
            "ttft_ms": per_token[0] if per_token else float("nan"),
            "e2e_ms": per_token[-1] if per_token else float("nan"),
            "iterations": len(self.windows),
            "windows": [list(w) for w in self.windows],  # (k drafted, n accepted) per verify pass
        }
        stats.update(acceptance_stats(self.windows))
        for phase, spans in self._phases.items():
            stats[f"{phase}_ms"] = sum(elapsed(a, b) for a, b in spans)
        return stats


def acceptance_stats(windows: list[tuple[int, int]]) -> dict:
    """Acceptance rate = accepted / checked, where a rejected window checked n+1 drafts and a full one k."""
    windows = [(k, n) for k, n in windows if k > 0]
    accepted = sum(n for _, n in windows)
    checked = sum(n + 1 if n < k else k for k, n in windows)
    lengths = [n for _, n in windows]
    return {
        "acceptance_rate": accepted / checked if checked else float("nan"),
        "mean_accepted_length": accepted / len(windows) if windows else float("nan"),
        "accepted_length_histogram": dict(sorted(Counter(lengths).items())),
        "draft_tokens": sum(k for k, _ in windows),
        "accepted_tokens": accepted,
    }
