"""Result rows: one per (prompt, system); written as records.csv and summary.csv, printed as a table."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from specter.metrics import GenerationResult

ROW_STATS = ("tpot_ms", "ttft_ms", "e2e_ms", "acceptance_rate", "mean_accepted_length", "iterations",
             "generated_tokens", "hits", "hits_prefetched", "misses", "prefetch_loads", "hit_rate", "h2d_bytes",
             "h2d_bytes_per_token", "h2d_gbps", "wait_ms", "draft_ms", "verify_ms", "working_set_mean",
             "prefetch_precision", "prefetch_recall")


def record(system: str, prompt_id: int, result: GenerationResult, reference: list[int] | None) -> dict:
    """One result row; `reference` is target-only's tokens for the same prompt (None when not run)."""
    row = {"system": system, "prompt_id": prompt_id, "status": "ok"}
    row.update({key: result.stats.get(key, float("nan")) for key in ROW_STATS})
    row["accepted_length_histogram"] = json.dumps(result.stats.get("accepted_length_histogram", {}))
    row["tokens_match_target"] = "" if reference is None else ("yes" if result.token_ids == reference else "no")
    return row


def unavailable(system: str, reason: str) -> dict:
    """The row of a system that cannot run here: a reason, never a number."""
    return {"system": system, "prompt_id": -1, "status": f"unavailable: {reason}"}


def summarize(records: pd.DataFrame) -> pd.DataFrame:
    """Per system: mean TPOT/TTFT, acceptance, whether every output matched target-only, and speedup."""
    ok = records[records.status == "ok"]
    summary = ok.groupby("system", sort=False).agg(
        tpot_ms=("tpot_ms", "mean"), ttft_ms=("ttft_ms", "mean"), acceptance_rate=("acceptance_rate", "mean"),
        mean_accepted_length=("mean_accepted_length", "mean"), hit_rate=("hit_rate", "mean"),
        h2d_mb_per_token=("h2d_bytes_per_token", lambda s: s.mean() / 1e6), prompts=("prompt_id", "nunique"),
        tokens_identical=("tokens_match_target", lambda s: "yes" if (s == "yes").all() else
                          ("" if (s == "").all() else "no")),
    ).reset_index()
    if "specter" in set(summary.system):
        specter_tpot = summary.loc[summary.system == "specter", "tpot_ms"].iloc[0]
        summary["specter_speedup"] = summary.tpot_ms / specter_tpot
    missing = records[records.status != "ok"][["system", "status"]].drop_duplicates()
    return pd.concat([summary, missing], ignore_index=True) if len(missing) else summary


def write_tables(out_dir: Path, rows: list[dict]) -> pd.DataFrame:
    """Write records.csv and summary.csv into the (new) results directory; returns the summary."""
    records = pd.DataFrame(rows)
    summary = summarize(records)
    records.to_csv(out_dir / "records.csv", index=False)
    summary.to_csv(out_dir / "summary.csv", index=False)
    return summary


def format_table(summary: pd.DataFrame) -> str:
    return summary.to_string(index=False, float_format=lambda x: f"{x:.3f}", na_rep="-")
