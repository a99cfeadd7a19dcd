"""Expert loads a confidence-gated draft length would save, on a calibrated build (CPU, no timing).

    python scripts/sim_draft_gate.py --model dsv2 --layers 4 --prompts 3 --k 16 32 --slots 16 4

A verify window loads every expert its positions route to that is not resident, whether or not the
position is accepted: the positions after a window's first rejected draft cost loads and commit nothing.
A gate stops drafting at the first draft token whose draft probability (softmax top-1) is below a
threshold (at least `--min-draft` tokens), so the window ends where a rejection is likely.
Greedy decoding commits the same tokens with any window lengths, so one greedy walk of the target per
prompt fixes every window's inputs; from it the script takes
- the target's routing of each committed token (`committed_routing`: what the verify pass routes);
- the draft's probability and agreement at each position, from one draft-mode forward over the walk (the
  engine drafts with the target's KV before the window and the draft's own inside it: an approximation);
and replays windows of up to K drafts: a window verifies its uncached token and v drafts, commits its
accepted drafts plus one, and loads, per MoE layer, the experts of its positions not among the `slots`
kept from the window before (`last_loaded`, what an LRU slot cache keeps; `sim_window_retention.py`).
The routing of a rejected draft is taken as the committed token's at that position. No prefetch.
It prints, per K, slots and threshold, expert loads per committed token (per MoE layer), their ratio to
the ungated window, mean drafted and accepted tokens per window and windows per committed token.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from experiments.routing_trace import committed_routing  # noqa: E402
from scripts.fit_calibration import greedy_walk, local_prompts  # noqa: E402
from scripts.sim_window_retention import kept_after  # noqa: E402
from specter.models.calibrated import moe_layer_count  # noqa: E402
from specter.models.loading import load_model  # noqa: E402

THRESHOLDS = (0.0, 0.5, 0.7, 0.8, 0.9, 0.95)


class Walk:
    """One prompt's greedy walk: routing [layer][T][k] of each committed token, the draft's top-1
    probability [T] and whether its top-1 is the committed token [T], per committed position."""

    def __init__(self, routing: list, draft_prob: list[float], draft_agrees: list[bool]) -> None:
        self.routing, self.draft_prob, self.draft_agrees = routing, draft_prob, draft_agrees

    def __len__(self) -> int:
        return len(self.draft_prob)


@torch.inference_mode()
def record_walk(model, prompt: torch.Tensor, tokens: int) -> Walk:
    walk = greedy_walk(model, prompt, tokens)
    ids = torch.cat([prompt, torch.tensor([walk])], dim=1).to(model.device)
    logits = model.forward(ids, DynamicCache(config=model.hf.config), mode="draft")[0].float()  # [T, V]
    n = prompt.numel()
    probs = logits[n - 1:-1].softmax(dim=-1)  # [tokens, V]: the positions that predict the walk
    top = probs.max(dim=-1)
    agrees = (top.indices.cpu() == torch.tensor(walk)).tolist()
    return Walk(committed_routing(model, prompt, walk), top.values.cpu().tolist(), agrees)


def window_length(walk: Walk, start: int, k: int, threshold: float, min_draft: int) -> int:
    """Drafts the gate keeps in a window whose first draft predicts committed position start + 1."""
    v = 0
    while v < k and start + v + 1 < len(walk):
        if v >= min_draft and walk.draft_prob[start + v + 1] < threshold:
            break
        v += 1
    return v


def replay(walk: Walk, k: int, slots: int, threshold: float, min_draft: int) -> dict:
    """Loads, committed tokens, drafts and accepted drafts over the walk's windows."""
    layers = len(walk.routing)
    resident = [set() for _ in range(layers)]
    loads = committed = drafted = accepted_total = windows = 0
    start = 0  # the window's uncached token: committed position `start`
    while start < len(walk) - 1:
        v = window_length(walk, start, k, threshold, min_draft)
        accepted = 0
        while accepted < v and walk.draft_agrees[start + accepted + 1]:
            accepted += 1
        positions = range(start, start + v + 1)
        nxt = min(start + accepted + 1, len(walk) - 1)  # the bonus token past the walk's end is not counted
        for layer in range(layers):
            window = [walk.routing[layer][p] for p in positions]
            needed = {e for token in window for e in token}
            loads += len(needed - resident[layer])
            resident[layer] = kept_after("last_loaded", window, resident[layer], slots, [])
        committed += nxt - start
        drafted += v
        accepted_total += accepted
        windows += 1
        start = nxt
    return {"loads": loads, "committed": committed, "drafted": drafted, "accepted": accepted_total,
            "windows": windows, "layers": layers}


def summary(rows: list[dict]) -> dict:
    total = {key: sum(r[key] for r in rows) for key in ("loads", "committed", "drafted", "accepted", "windows")}
    layers = rows[0]["layers"]
    return {"loads_per_token_layer": total["loads"] / total["committed"] / layers,
            "drafted_per_window": total["drafted"] / total["windows"],
            "accepted_per_window": total["accepted"] / total["windows"],
            "windows_per_token": total["windows"] / total["committed"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dsv2")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers built (full width)")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per local dataset")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--k", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--slots", type=int, nargs="+", default=[16, 4], help="experts kept per MoE layer")
    parser.add_argument("--thresholds", type=float, nargs="+", default=list(THRESHOLDS))
    parser.add_argument("--min-draft", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    model = load_model(args.model, weights="calibrated", num_layers=args.layers, device="cpu",
                       dtype=getattr(torch, args.dtype), seed=0)
    walks = [record_walk(model, p, args.tokens) for p in local_prompts(model.tokenizer, args.prompts)]
    agree = sum(sum(w.draft_agrees) for w in walks) / sum(len(w) for w in walks)
    print(f"{args.model}: {args.layers} layers ({moe_layer_count(model.hf.config)} MoE), "
          f"{len(walks)} walks x {args.tokens} tokens, draft top-1 agreement {agree:.3f} "
          f"({time.perf_counter() - started:.0f} s)")
    print("| K | slots | threshold | loads / token / layer | x ungated | drafted / window | accepted / window "
          "| windows / token |")
    print("|---|---|---|---|---|---|---|---|")
    for k in args.k:
        for slots in args.slots:
            base = None
            for threshold in args.thresholds:
                s = summary([replay(w, k, slots, threshold, args.min_draft) for w in walks])
                base = base or s["loads_per_token_layer"]
                print(f"| {k} | {slots} | {threshold} | {s['loads_per_token_layer']:.3f} | "
                      f"{s['loads_per_token_layer'] / base:.3f} | {s['drafted_per_window']:.1f} | "
                      f"{s['accepted_per_window']:.1f} | {s['windows_per_token']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
