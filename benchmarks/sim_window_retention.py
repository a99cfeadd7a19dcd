"""Expert loads per verify window under window-level retention policies, on simulated calibrated routing (CPU, seconds).

    python benchmarks/sim_window_retention.py --models dsv2 qwen --slots 16 8 --windows 16 24 32

A verify window needs every expert its tokens route to; `slots` of them per layer persist to the next
window. The routing is the calibrated profile's simulation (`routing_codes` through random router rows,
as `scripts/fit_calibration.py` simulates it: no model is built), per layer, committed tokens cut into
windows of `window` tokens. Policies, i.e. which `slots` experts of a window stay resident after it:
- last_loaded: the verify order's last (hits first, then loads most frequent first): what an LRU slot
  cache keeps after a verify pass;
- most_frequent: the window's most used experts;
- most_recent_use: the experts used at the window's latest positions;
- oracle_next: the next window's experts first (an upper bound for any policy, e.g. one reading the
  drafts made ahead).
It prints loads per window and per policy, and each policy's ratio to last_loaded. No prefetch and no
timing: it bounds what retention alone can save (results/reference/calibrated-h200/NOTES.md).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specter.models.calibrated import simulated_routing  # noqa: E402
from specter.models.loading import hf_config  # noqa: E402
from specter.models.registry import get_spec  # noqa: E402

POLICIES = ("last_loaded", "most_frequent", "most_recent_use", "oracle_next")


def model_routing(name: str, layers: int, tokens: int, seed: int) -> list[list[list[int]]]:
    """[layers][tokens][top_k] expert ids of the model's calibrated routing simulation."""
    spec = get_spec(name)
    config = hf_config(spec)
    generator = torch.Generator().manual_seed(seed)
    d_r = max(8, config.hidden_size // 4)
    return simulated_routing(tokens, spec.routing_profile, spec.num_experts, config.num_experts_per_tok, d_r, layers,
                             generator)


def kept_after(policy: str, window: list[list[int]], resident: set, slots: int, next_window: list[list[int]]) -> set:
    """The experts that stay resident after verifying `window` ([T][k]) with `resident` at its start."""
    counts: dict[int, int] = {}
    for token in window:
        for expert in token:
            counts[expert] = counts.get(expert, 0) + 1
    need = set(counts)
    if policy == "last_loaded":
        def order(experts):
            return sorted(experts, key=lambda e: (-counts[e], e))
        keep = (order(need & resident) + order(need - resident))[-slots:]  # hits, then loads
    elif policy == "most_frequent":
        keep = sorted(need, key=lambda e: (-counts[e], e))[:slots]
    elif policy == "most_recent_use":
        last = {e: i for i, token in enumerate(window) for e in token}
        keep = sorted(need, key=lambda e: (-last[e], e))[:slots]
    elif policy == "oracle_next":
        upcoming = {e for token in next_window for e in token}
        keep = (sorted(need & upcoming) + sorted(need - upcoming))[:slots]
    else:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    spare = [e for e in sorted(resident) if e not in keep][:max(0, slots - len(keep))]  # unused slots keep theirs
    return set(keep) | set(spare)


def loads_per_window(trace: list[list[int]], slots: int, window: int, policy: str) -> float:
    """Mean experts loaded per window of `window` tokens of one layer's `trace` ([T][k])."""
    windows = [trace[i:i + window] for i in range(0, len(trace) - window + 1, window)]
    resident: set = set()
    loads = []
    for w, tokens in enumerate(windows):
        loads.append(len({e for token in tokens for e in token} - resident))
        resident = kept_after(policy, tokens, resident, slots, windows[w + 1] if w + 1 < len(windows) else [])
    return statistics.mean(loads)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["dsv2", "qwen"])
    parser.add_argument("--slots", nargs="+", type=int, default=[16, 8], help="slots per layer, one per model")
    parser.add_argument("--windows", nargs="+", type=int, default=[16, 24, 32], help="committed tokens per window")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1536)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if len(args.slots) != len(args.models):
        parser.error("give one --slots value per model")
    for name, slots in zip(args.models, args.slots):
        routing = model_routing(name, args.layers, args.tokens, args.seed)
        for window in args.windows:
            loads = {p: statistics.mean(loads_per_window(t, slots, window, p) for t in routing) for p in POLICIES}
            base = loads["last_loaded"]
            print(f"{name} slots={slots} window={window}: " + ", ".join(
                f"{p} {v:.2f} ({v / base:.3f})" for p, v in loads.items()), flush=True)


if __name__ == "__main__":
    main()
