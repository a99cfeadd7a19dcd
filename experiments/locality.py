"""Routing locality of a recorded routing trace: hit rates of per-layer expert caches (LRU, LFU, Belady,
lookahead eviction) at capacities rho x top_k, computed as the moe-lrc study does for routing-locality.tsv.

A trace is one layer's routing of consecutive tokens, [T, k] expert ids in rank order. For each token its
k experts are looked up first (hits against the cache as the previous token left it), then inserted in
rank order, each insertion evicting by the policy. A first use of an expert counts as a hit while fewer
than `capacity` distinct experts have been seen (the cache is as if pre-filled), so short traces are not
penalised by cold misses.
"""
from __future__ import annotations

import csv
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

RHOS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0)
POLICIES = ("LRU", "LFU", "Belady", "SCH16")
REFERENCE_TSV = Path(__file__).resolve().parent / "reference" / "routing-locality.tsv"
REAL_NAMES = {"dsv2": "DeepSeek-V2-Lite", "qwen": "Qwen1.5-MoE-A2.7B", "phi": "Phi-3.5-MoE",
              "mixtral": "Mixtral-8x7B-v0.1", "deepseek_v2": "DeepSeek-V2-Lite", "qwen2_moe": "Qwen1.5-MoE-A2.7B",
              "phimoe": "Phi-3.5-MoE"}

Trace = Sequence[Sequence[int]]
Victim = Callable[[list[int], int, int], int]  # (cache in recency order, token index, inserted) -> victim


def hit_rate(trace: Trace, capacity: int, victim: Victim) -> float:
    """Fraction of the trace's expert uses that hit a cache of `capacity` experts evicting by `victim`."""
    cache: list[int] = []  # least recently used first
    seen: set[int] = set()
    hits = total = 0
    for t, experts in enumerate(trace):
        resident = set(cache)
        for e in experts:
            first_use = e not in seen
            hits += (e in resident) or (first_use and len(seen) < capacity)
            seen.add(e)
        total += len(experts)
        for e in experts:
            if e in cache:
                cache.remove(e)
            cache.append(e)
            if len(cache) > capacity:
                cache.remove(victim(cache, t, e))
    return hits / max(total, 1)


def lru_victim(cache: list[int], t: int, inserted: int) -> int:
    return cache[0]


def lfu_victim_for(trace: Trace) -> Victim:
    """Least frequently used so far (ties: least recent)."""
    counts = [np.bincount(np.asarray(trace[: t + 1]).ravel()) for t in range(len(trace))]

    def victim(cache: list[int], t: int, inserted: int) -> int:
        freq = counts[t]
        return min((e for e in cache if e != inserted), key=lambda e: (freq[e] if e < len(freq) else 0))
    return victim


def next_use_table(trace: Trace) -> list[dict[int, int]]:
    """[t] -> {expert: the next token index after t that uses it}."""
    table, upcoming = [None] * len(trace), {}
    for t in range(len(trace) - 1, -1, -1):
        table[t] = dict(upcoming)
        for e in trace[t]:
            upcoming[e] = t
    return table


def belady_victim_for(trace: Trace) -> Victim:
    """Evict the expert needed furthest in the future, the one just used included (never needed: first)."""
    table = next_use_table(trace)
    far = len(trace) + 1

    def victim(cache: list[int], t: int, inserted: int) -> int:
        return max(reversed(cache), key=lambda e: table[t].get(e, far))
    return victim


def lookahead_victim_for(trace: Trace, horizon: int = 16) -> Victim:
    """Evict the expert with the fewest uses in the next `horizon` tokens (ties: least recent)."""
    arr = np.asarray(trace)

    def victim(cache: list[int], t: int, inserted: int) -> int:
        future = np.bincount(arr[t + 1: t + 1 + horizon].ravel(), minlength=max(cache) + 1)
        return min((e for e in cache if e != inserted), key=lambda e: future[e])
    return victim


def policy_victim(policy: str, trace: Trace) -> Victim:
    if policy == "LRU":
        return lru_victim
    if policy == "LFU":
        return lfu_victim_for(trace)
    if policy == "Belady":
        return belady_victim_for(trace)
    if policy == "SCH16":
        return lookahead_victim_for(trace, 16)
    raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")


def locality_curves(traces: Sequence[Trace], top_k: int, policies: Sequence[str] = POLICIES,
                    rhos: Sequence[float] = RHOS) -> dict[tuple[str, float], float]:
    """{(policy, rho): hit rate}, averaged over traces (one per layer and sequence) weighted by length."""
    out = {}
    for policy in policies:
        for rho in rhos:
            capacity = max(1, int(round(rho * top_k)))
            rates = [hit_rate(t, capacity, policy_victim(policy, t)) for t in traces if len(t)]
            weights = [len(t) for t in traces if len(t)]
            out[(policy, rho)] = float(np.average(rates, weights=weights)) if rates else float("nan")
    return out


def reference_curves(real_name: str, path: Path = REFERENCE_TSV) -> dict[tuple[str, float], float]:
    """The real model's hit rates from routing-locality.tsv: {(policy, rho): rate} ('~' values included)."""
    out = {}
    with open(path) as f:
        rows = [line for line in f if not line.startswith("#")]
    for row in csv.DictReader(rows, delimiter="\t"):
        if row["model"] != real_name:
            continue
        for col, value in row.items():
            if col.startswith("rho") and value:
                out[(row["metric"], float(col[3:]))] = float(value.lstrip("~"))
    return out


def calibration_error(measured: dict, target: dict) -> tuple[float, float]:
    """(largest, mean) absolute difference over the target's points."""
    diffs = [abs(measured[key] - value) for key, value in target.items()]
    return max(diffs), float(np.mean(diffs))
