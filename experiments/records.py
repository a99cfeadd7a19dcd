"""Result rows: one per (dataset, prompt, repeat, system), appended to records.csv as they come; summaries."""
from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path

import pandas as pd

from specter.metrics import GenerationResult, io_floor_ms
from specter.token_time import PARTS

TPOT_PARTS = tuple(f"tpot_{part}_ms" for part in PARTS)  # where each token's time went (specter.token_time)
PART_HEADINGS = {"tpot_draft_ms": "draft", "tpot_copy_wait_ms": "copies", "tpot_rebuild_ms": "rebuild",
                 "tpot_target_ms": "target pass", "tpot_host_ms": "host"}

BYTES_STATS = ("decode_h2d_bytes_per_token", "prefill_h2d_bytes")  # the one definition: specter.metrics.h2d_split
ROW_STATS = ("tpot_ms", "ttft_ms", "e2e_ms", "acceptance_rate", "mean_accepted_length", "iterations",
             "generated_tokens", "hits", "hits_prefetched", "misses", "prefetch_loads", "hit_rate", "h2d_bytes",
             *BYTES_STATS, "h2d_gbps", "wait_ms", "draft_ms", "verify_ms", "working_set_mean",
             "prefetch_precision", "prefetch_recall", "throughput_tok_s", "io_floor_ms", "link_gbps",
             *TPOT_PARTS)
KEY = ("system", "dataset", "prompt_id", "repeat", "k", "prefix_tokens", "batch_size")
FIELDS = (*KEY, "status", *ROW_STATS, "accepted_length_histogram", "tokens_match_target", "token_agreement",
          "token_check", "mechanisms", "invocation")
SAME_CASE = ("dataset", "prompt_id", "repeat", "k", "prefix_tokens", "batch_size", "invocation")  # within one run


def record(key: dict, result: GenerationResult, reference: list[int] | None, h2d_gbps: float | None = None,
           check=None) -> dict:
    """One result row; `reference` is target-only's tokens for the same case (None when not run), `check` the
    verdict on them (experiments.token_check.TokenCheck: equal, numeric tie or MISMATCH); `h2d_gbps` is the
    link's measured rate (None without a GPU): the row's I/O floor, io_floor_ms, is its decoding bytes per
    committed token at that rate (empty for a system that moves no experts)."""
    row = {**key, "status": "ok"}
    row.update({stat: result.stats.get(stat, float("nan")) for stat in ROW_STATS})
    floor = io_floor_ms(row["decode_h2d_bytes_per_token"], h2d_gbps)
    row["io_floor_ms"] = "" if floor != floor else floor  # empty without a GPU or without bytes
    row["link_gbps"] = h2d_gbps if h2d_gbps else ""
    row["accepted_length_histogram"] = json.dumps(result.stats.get("accepted_length_histogram", {}))
    row["mechanisms"] = mechanisms_ran(result.stats.get("mechanisms"))
    row["tokens_match_target"] = "" if reference is None else ("yes" if result.token_ids == reference else "no")
    row["token_agreement"] = "" if reference is None else token_agreement(result.token_ids, reference)
    row["token_check"] = "" if check is None else check.text()
    return row


def mechanisms_ran(mechanisms: dict | None) -> str:
    """records.csv's `mechanisms`: the mechanisms that ran, space-separated ("" for a system without them)."""
    return " ".join(name for name, state in (mechanisms or {}).items() if state == "on")


def token_agreement(tokens: list[int], reference: list[int]) -> float:
    """Fraction of the reference's positions where `tokens` holds the same token."""
    same = sum(a == b for a, b in zip(tokens, reference))
    return round(same / max(len(reference), 1), 4)


def unavailable(key: dict, reason: str) -> dict:
    """The row of a system or dataset that cannot run here: a reason, never a number."""
    return {**key, "status": f"unavailable: {reason}"}


def read_records(path: Path, repair: bool = False) -> pd.DataFrame:
    """records.csv as a frame, without a torn last row (a write cut by a kill, power loss or a full disk: the
    file does not end in a newline, or its last row has too few fields or an `ok` row's TPOT does not parse),
    which is reported on stderr; with `repair` it is cut from the file too, so that appended rows start on a
    line of their own and its case is decoded again."""
    data = path.read_bytes()
    keep = whole_rows(data)
    if len(keep) < len(data):
        print(f"warning: {path}: dropped a torn last row ({len(data) - len(keep)} bytes); that case counts as "
              f"not run", file=sys.stderr)
        if repair:
            with open(path, "r+b") as f:
                f.truncate(len(keep))
        data = keep
    if not data:
        return pd.DataFrame(columns=FIELDS)
    return pd.read_csv(io.BytesIO(data), keep_default_na=False)


def whole_rows(data: bytes) -> bytes:
    """`data` (a records.csv's bytes) up to the end of its last whole row."""
    keep = data[:data.rfind(b"\n") + 1]
    lines = keep.splitlines(keepends=True)
    if len(lines) < 2:
        return keep
    header, last = (next(csv.reader([line.decode(errors="replace")]), []) for line in (lines[0], lines[-1]))
    row = dict(zip(header, last))
    whole = len(last) == len(header) and row.get("invocation") != ""  # the writer's last column, never empty
    if whole and (row.get("status") != "ok" or parses_as_float(row.get("tpot_ms"))):
        return keep
    return keep[:len(keep) - len(lines[-1])]


def parses_as_float(text: str | None) -> bool:
    try:
        float(text)
    except (TypeError, ValueError):
        return False
    return True


class RecordWriter:
    """Appends rows to <dir>/records.csv as they are produced (a crash keeps what was measured).

    With `resume`, rows already in the file are kept and `done(key)` tells which cases to skip. `link`: the
    process's RunLink, measured by `measure_link()` after the warm-ups, whose rate gives every later row its I/O
    floor (`h2d_gbps`: a rate known beforehand instead); `invocation`: the index in run.json's invocations of the
    process writing (rows of one invocation ran in one process on one host).
    """

    def __init__(self, out_dir: Path, resume: bool = False, h2d_gbps: float | None = None,
                 invocation: int = 0, link=None) -> None:
        self.path = out_dir / "records.csv"
        self.fixed_gbps, self.link, self.invocation = h2d_gbps, link, invocation
        self.rows: list[dict] = []
        self.fields = FIELDS
        if resume and self.path.exists():
            self.rows = read_records(self.path, repair=True).to_dict("records")
            self.fields = existing_fields(self.path) or FIELDS  # a file from before a column was added keeps its own
        if not self.path.exists() or not resume or self.path.stat().st_size == 0:
            with open(self.path, "w", newline="") as f:
                csv.DictWriter(f, fieldnames=FIELDS).writeheader()
        self._done = {self._key(r) for r in self.rows if r.get("status") == "ok"}

    @property
    def h2d_gbps(self) -> float | None:
        """The rate of the rows' I/O floors: the link's measured maximum (None before it is measured)."""
        return self.link.floor_gbps if self.link is not None else self.fixed_gbps

    def measure_link(self) -> None:
        """Measure the link now (once; after the warm-ups, with the GPU otherwise idle)."""
        if self.link is not None:
            self.link.measure()

    @staticmethod
    def _key(row: dict) -> tuple:
        return tuple(str(row.get(k, "")) for k in KEY)

    def done(self, key: dict) -> bool:
        return self._key(key) in self._done

    def add(self, row: dict) -> None:
        row = {**row, "invocation": self.invocation}
        self.rows.append(row)
        if row.get("status") == "ok":
            self._done.add(self._key(row))
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.fields, extrasaction="ignore").writerow(row)


def existing_fields(path: Path) -> tuple[str, ...] | None:
    """The columns of an existing records.csv when its header is whole and names only known columns, with
    every key column (rows appended to it keep that header's columns); None otherwise."""
    with open(path, newline="") as f:
        header = next(csv.reader(f), [])
    if set(KEY) <= set(header) and set(header) <= set(FIELDS):
        return tuple(header)
    return None


SUMMARY_KEYS = {  # experiment -> the columns its summary groups by
    "main": ("system", "dataset"), "routing": ("system", "dataset"), "kernel": ("system", "dataset"),
    "depth": ("system", "k"), "prefix": ("system", "prefix_tokens"), "batch": ("system", "batch_size", "dataset"),
}


def summarize(records: pd.DataFrame, by: tuple[str, ...] = ("system", "dataset")) -> pd.DataFrame:
    """Per group: the median of each per-decode metric (TPOT also as min, max and a labelled mean), an AVG row
    per system (the mean of its datasets' medians), each system's median TPOT over Specter's on the cases both
    ran in one process (`tpot_over_specter`), over its own I/O floor (`tpot_over_io_floor`) and, for the
    Specter systems, over the lowest floor among the other systems of the group (`tpot_over_peer_floor`)."""
    if records.empty:
        return records
    missing = records[records.status != "ok"][[c for c in ("system", "dataset", "status") if c in records]]
    ok = records[records.status == "ok"].copy()
    if ok.empty:
        return missing.drop_duplicates().reset_index(drop=True)
    for col in ROW_STATS:  # a column missing from an older file reads as not measured
        ok[col] = pd.to_numeric(ok[col], errors="coerce") if col in ok else float("nan")
    ok["token_agreement"] = pd.to_numeric(ok.get("token_agreement", pd.Series(index=ok.index, dtype=float)),
                                          errors="coerce")
    metrics = {"tpot_median_ms": "median", "tpot_mean_ms": "mean", "tpot_min_ms": "min", "tpot_max_ms": "max",
               "ttft_ms": "median", "acceptance_rate": "median", "mean_accepted_length": "median",
               "hit_rate": "median", "decode_h2d_bytes_per_token": "median", "prompt_id": "nunique"}
    for optional in ("throughput_tok_s", "working_set_mean", "token_agreement", "prefill_h2d_bytes", "io_floor_ms",
                     *TPOT_PARTS):
        if ok[optional].notna().any():
            metrics[optional] = "median"
    ok = ok.assign(tpot_median_ms=ok.tpot_ms, tpot_mean_ms=ok.tpot_ms, tpot_min_ms=ok.tpot_ms, tpot_max_ms=ok.tpot_ms)
    summary = ok.groupby(list(by), sort=False).agg(metrics).reset_index().rename(columns={"prompt_id": "prompts"})
    summary["decode_mb_per_token"] = summary.pop("decode_h2d_bytes_per_token") / 1e6
    if "io_floor_ms" in summary:
        summary["tpot_over_io_floor"] = summary.tpot_median_ms / summary.io_floor_ms
    if ok.link_gbps.notna().any():
        summary["rate_over_link"] = ok.assign(rate=rate_over_link(ok)).groupby(list(by), sort=False).rate.max().values
    summary["tokens_identical"] = [_identical(ok, row, by) for _, row in summary.iterrows()]
    summary["tpot_over_specter"] = summary.set_index(list(by)).index.map(same_run_ratios(ok, list(by))).values
    if "dataset" in by:  # AVG's ratio: the mean of its datasets' same-run ratios
        avg = summary.groupby([c for c in by if c != "dataset"], sort=False).mean(numeric_only=True).reset_index()
        avg["dataset"] = "AVG"
        avg["tokens_identical"] = ""
        summary = pd.concat([summary, avg], ignore_index=True)
    if summary.tpot_over_specter.isna().all():
        summary = summary.drop(columns="tpot_over_specter")
    if "io_floor_ms" in summary:
        summary = _with_peer_floor(summary, [c for c in by if c != "system"])
    summary = pd.concat([summary, missing.drop_duplicates()], ignore_index=True) if len(missing) else summary
    for count in ("batch_size", "prompts"):  # whole numbers, also on AVG rows
        if count in summary:
            summary[count] = pd.to_numeric(summary[count], errors="coerce").round().astype("Int64")
    return summary


# A link trial times 16 back-to-back 64 MiB copies with the launch gaps between them, a system's copies are timed one
# by one, so those may read slightly above the best trial (0.11% for the paper's design at phi16, H100); beyond
# this fraction the link measurement is too low.
LINK_TOLERANCE = 0.01


def beats_link(over: pd.Series) -> pd.Series:
    """Rows whose rate_over_link exceeds the link beyond LINK_TOLERANCE."""
    return over > 1 + LINK_TOLERANCE


def rate_over_link(ok: pd.DataFrame) -> pd.Series:
    """Per row: the faster of its decode copies' own rate and its bytes per committed token over its TPOT, over the
    link rate measured for the run (above 1: the system moved data faster than the measured link, so the
    measurement, and every floor from it, is too low)."""
    moved = ok.decode_h2d_bytes_per_token / (ok.tpot_ms * 1e6)  # GB/s the decode needed on average
    return pd.concat([ok.h2d_gbps, moved], axis=1).max(axis=1) / ok.link_gbps


def _identical(ok: pd.DataFrame, row, by) -> str:
    mask = pd.Series(True, index=ok.index)
    for col in by:
        mask &= ok[col] == row[col]
    return token_summary(ok[mask])


def token_verdict(check: str, match: str) -> str:
    """One case's verdict from its `token_check` text, or from `tokens_match_target` in a file without it:
    equal, tie, MISMATCH, differ (not classified) or "" (not compared)."""
    if check:
        return "tie" if check.startswith("numeric tie") else check.split()[0]
    return {"yes": "equal", "no": "differ"}.get(match.lower(), "")


def token_summary(rows: pd.DataFrame) -> str:
    """`15/15 equal`, `14/15 equal, 1 numeric tie`, `13/15 equal, 2 MISMATCH`: the cases' verdicts against
    target-only ("" where none was compared)."""
    empty = pd.Series("", index=rows.index)
    checks, matches = (rows.get(c, empty).fillna("").astype(str) for c in ("token_check", "tokens_match_target"))
    verdicts = [v for v in map(token_verdict, checks, matches) if v]
    if not verdicts:
        return ""
    counts = {v: verdicts.count(v) for v in ("tie", "MISMATCH", "differ")}
    names = {"tie": "numeric tie", "MISMATCH": "MISMATCH", "differ": "differ (not classified)"}
    extra = [f"{n} {names[v]}{'s' if v == 'tie' and n > 1 else ''}" for v, n in counts.items() if n]
    return ", ".join([f"{verdicts.count('equal')}/{len(verdicts)} equal", *extra])


def same_run_ratios(ok: pd.DataFrame, by: list[str], reference: str = "specter") -> pd.Series:
    """Per group of `by`: the median TPOT of a system over `reference`'s, both over the cases they ran in the
    same process (same dataset, prompt, repeat and invocation: a resumed run's rows from another host are
    never paired); NaN where no case pairs. Above 1, `reference` is that many times faster."""
    keys = [c for c in SAME_CASE if c in ok]
    ok = ok.assign(case=ok[keys].apply(lambda col: col.map(str)).agg("|".join, axis=1) if keys else "")
    base = ok[ok.system == reference].groupby("case").tpot_ms.median()  # the reference's TPOT per case
    if base.empty:
        return pd.Series(dtype=float)
    paired = ok[ok.case.isin(base.index)].assign(reference_tpot=lambda f: f.case.map(base))
    medians = paired.groupby(by, sort=False)[["tpot_ms", "reference_tpot"]].median()
    return medians.tpot_ms / medians.reference_tpot


def _with_peer_floor(summary: pd.DataFrame, group: list[str]) -> pd.DataFrame:
    """For each Specter system: TPOT over the lowest I/O floor among the group's other systems
    (`tpot_over_peer_floor`, and which system's it is: `lowest_peer_floor`)."""
    peers = summary[~summary.system.astype(str).str.startswith("specter") & summary.io_floor_ms.notna()]
    if peers.empty:
        return summary
    lowest = peers.loc[peers.groupby(group, sort=False).io_floor_ms.idxmin()].set_index(group)
    keys = summary[group].apply(tuple, axis=1) if len(group) > 1 else summary[group[0]]
    floor, name = keys.map(lowest.io_floor_ms), keys.map(lowest.system)
    mine = summary.system.astype(str).str.startswith("specter")
    summary["tpot_over_peer_floor"] = (summary.tpot_median_ms / floor).where(mine)
    summary["lowest_peer_floor"] = name.where(mine)
    return summary


def write_summary(out_dir: Path, rows: list[dict], by: tuple[str, ...] = ("system", "dataset")) -> pd.DataFrame:
    summary = summarize(pd.DataFrame(rows), by)
    summary.to_csv(out_dir / "summary.csv", index=False)
    return summary


TABLE_COLUMNS = {  # summary column -> console heading; every column stays in summary.csv
    "tpot_median_ms": "TPOT ms", "tpot_over_specter": "x Specter", "acceptance_rate": "accept",
    "decode_mb_per_token": "MB/token", "tpot_over_io_floor": "x floor", "tokens_identical": "same tokens"}


def format_table(summary: pd.DataFrame, width: int = 120) -> str:
    """The columns a reader compares systems by (medians per decode), then one line per unavailable row;
    summary.csv has every column."""
    status = summary["status"] if "status" in summary else pd.Series("", index=summary.index)
    failed = status.fillna("").astype(str).str.startswith("unavailable")
    ok = summary[~failed]
    keys = [c for c in ("system", "dataset", "k", "prefix_tokens", "batch_size") if c in ok and ok[c].notna().any()]
    columns = keys + [c for c in TABLE_COLUMNS if c in ok and ok[c].replace("", float("nan")).notna().any()]
    table = ok[columns].rename(columns=TABLE_COLUMNS)
    text = table.to_string(index=False, float_format=lambda x: f"{x:.1f}" if abs(x) >= 100 else f"{x:.3f}",
                           na_rep="-") if len(ok) else ""
    lines = [text] if text else []
    lines += [f"{row.system} / {row.get('dataset', '-')}: {_cut(str(row.status), width - 20)}"
              for _, row in summary[failed].iterrows()]
    over = pd.to_numeric(ok["rate_over_link"], errors="coerce") if "rate_over_link" in ok else pd.Series(dtype=float)
    beaten = ok[beats_link(over.reindex(ok.index))]
    if len(beaten):
        worst = beaten.loc[beaten.rate_over_link.idxmax()]
        lines.append(f"warning: {worst.system} moved data {worst.rate_over_link:.2f}x faster than the measured link "
                     f"rate: that measurement is too low, so the I/O floors and x floor are not trustworthy")
    else:
        lines += peer_floor_lines(ok)
    lines += time_per_token_lines(ok, keys)
    if "tpot_over_specter" in ok:
        lines.append("TPOT and the other columns: medians over decodes; x Specter: TPOT / Specter's on the same "
                     "cases (>1: Specter faster)")
    if "decode_mb_per_token" in ok:
        lines.append("MB/token: H2D bytes per committed token while decoding"
                     + ("; x floor: TPOT / those bytes at the run's H2D rate" if "tpot_over_io_floor" in ok else ""))
    return "\n".join(lines)


def time_per_token_lines(ok: pd.DataFrame, keys: list[str]) -> list[str]:
    """Where each system's time per token went (medians of the tpot_* columns, CUDA events; specter.token_time)."""
    parts = [c for c in TPOT_PARTS if c in ok and pd.to_numeric(ok[c], errors="coerce").notna().any()]
    if not parts:
        return []
    table = ok[keys + parts].rename(columns=PART_HEADINGS)
    return ["time per token, ms (draft on the critical path, waiting for copies, rebuilding residual experts, the rest "
            "of the target pass, host between passes):",
            table.to_string(index=False, float_format=lambda x: f"{x:.3f}", na_rep="-")]


def peer_floor_lines(summary: pd.DataFrame) -> list[str]:
    """For each Specter system (per dataset, or its AVG row where there are several): its TPOT over the lowest
    I/O floor among the other systems, the bound no implementation of that system's design goes below."""
    if "tpot_over_peer_floor" not in summary:
        return []
    rows = summary[summary.tpot_over_peer_floor.notna()]
    if "dataset" in rows and rows.dataset.nunique() > 2:  # several datasets and their AVG: the AVG line
        rows = rows[rows.dataset == "AVG"]
    elif "dataset" in rows:
        rows = rows[rows.dataset != "AVG"]
    return [f"{row.system}{'' if 'dataset' not in row else ' / ' + str(row.dataset)}: TPOT "
            f"{row.tpot_over_peer_floor:.2f}x {row.lowest_peer_floor}'s I/O floor, the lowest among the peers "
            f"(no implementation of that design decodes faster)" for _, row in rows.iterrows()]


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
