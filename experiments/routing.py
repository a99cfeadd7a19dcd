"""Routing diversity (Figure 13: per-window expert working sets per dataset, Jensen-Shannon distances) and
routing locality (expert-cache hit-rate curves of the target's committed routing against the real model's)."""
from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.datasets import prompts_for
from experiments.figures import locality_figure
from experiments.locality import REAL_NAMES, locality_curves, reference_curves
from experiments.protocol import encode_prompts, warm_up
from experiments.records import SUMMARY_KEYS, record, unavailable
from experiments.routing_trace import committed_routing, topk_recall
from experiments.run_model import load
from experiments.settings import header
from experiments.systems import build_system


def js_distance(p: np.ndarray, q: np.ndarray) -> float:
    """Jensen-Shannon distance (base 2, in [0, 1]) between two count vectors."""
    p, q = p / p.sum(), q / q.sum()
    m = (p + q) / 2

    def kl(a, b):
        mask = a > 0
        return float(np.sum(a[mask] * np.log2(a[mask] / b[mask])))

    return float(np.sqrt(max(0.5 * kl(p, m) + 0.5 * kl(q, m), 0.0)))


def run_routing(cfg, out_dir: Path, open_writer):
    """Specter on every dataset's prompts; the target's routing per window and per dataset."""
    model, config = load(cfg)
    prompts = encode_prompts(model, prompts_for(cfg.dataset, cfg.num_prompts), cfg.prefix_tokens)
    engine = build_system("specter", model, config)
    writer = open_writer(model)
    sets, counts, traces, drafts = [], {}, [], []
    first = next((p[0] for p in prompts.values() if not isinstance(p, str)), None)
    if first is not None:
        warm_up([engine], first, cfg.warmup_tokens or cfg.max_new_tokens)
        writer.measure_link()
    for dataset, cases in prompts.items():
        key = {"system": "specter", "dataset": dataset, "k": config.k, "prefix_tokens": cfg.prefix_tokens}
        if isinstance(cases, str):
            writer.add(unavailable({**key, "prompt_id": -1}, cases.removeprefix("unavailable: ")))
            continue
        for i, ids in enumerate(cases):
            result = engine.generate(ids, cfg.max_new_tokens)
            writer.add(record({**key, "prompt_id": i, "repeat": 0}, result, None, writer.h2d_gbps))
            sets += [{"dataset": dataset, "prompt_id": i, "working_set": s} for s in result.stats["window_working_sets"]]
            layer_counts = np.array(result.stats["routing_counts"], dtype=float)  # [L, E]
            counts[dataset] = counts.get(dataset, 0) + layer_counts
            traces += committed_routing(model, ids, result.token_ids)
            drafts += committed_routing(model, ids, result.token_ids, mode="draft")
    pd.DataFrame(sets, columns=["dataset", "prompt_id", "working_set"]).to_csv(out_dir / "routing_working_sets.csv",
                                                                              index=False)
    pairs = [{"dataset_a": a, "dataset_b": b, "js_distance": js_distance(counts[a].ravel(), counts[b].ravel())}
             for a, b in itertools.combinations(counts, 2)]
    pd.DataFrame(pairs, columns=["dataset_a", "dataset_b", "js_distance"]).to_csv(out_dir / "routing_js.csv",
                                                                                 index=False)
    if traces:
        locality = locality_table(model, traces, topk_recall(drafts, traces))
        locality.to_csv(out_dir / "routing_locality.csv", index=False)
        locality_figure(locality, out_dir, "routing_locality")
    return header(model, config, cfg, "routing"), SUMMARY_KEYS["routing"]


def locality_table(model, traces, recall: float) -> pd.DataFrame:
    """routing_locality.csv rows (model, metric, rho, measured, real): LRU, LFU, Belady and 16-token
    lookahead-eviction hit rates of the target's committed routing, the real checkpoint's where the
    reference table has them, and the draft's top-k recall of the target's routing."""
    real_name = real_model_name(model.spec)
    real = reference_curves(real_name) if real_name else {}
    rows = [{"model": model.spec.name, "metric": metric, "rho": rho, "measured": round(value, 4),
             "real": real.get((metric, rho))}
            for (metric, rho), value in locality_curves(traces, model.top_k).items()]
    rows.append({"model": model.spec.name, "metric": "draft_topk_recall", "rho": None, "measured": round(recall, 4),
                 "real": None})
    return pd.DataFrame(rows, columns=["model", "metric", "rho", "measured", "real"])


def real_model_name(spec) -> str | None:
    """The real checkpoint whose reference row a model's curves are drawn against (tiny-mixtral: Mixtral's,
    the row its calibration fits; other tiny models: none)."""
    if spec.is_tiny:
        return REAL_NAMES["mixtral"] if spec.model_type == "mixtral" else None
    return REAL_NAMES.get(spec.name) or REAL_NAMES.get(spec.model_type)
