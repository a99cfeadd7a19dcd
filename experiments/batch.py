"""The batch experiment (Figures 15-16, Table 3): each system decodes B requests together, B swept."""
from __future__ import annotations

import math
import sys

import torch
from tqdm import tqdm

from experiments.datasets import prompts_for
from experiments.protocol import encode_prompts
from experiments.records import SUMMARY_KEYS, RecordWriter, record, unavailable
from experiments.run_model import keep_raw_experts, load
from experiments.settings import header
from experiments.systems import build_system
from specter.metrics import GenerationResult

WARMUP_TOKENS = 4
NO_BATCH_MODE = "this system's adapter has no batch mode (it decodes one request at a time)"


def run_batch(cfg, out_dir, open_writer):
    """Every batch-capable system on B requests per dataset (the dataset's prompts, cycled if fewer than B)."""
    model, config = load(cfg)
    prompts = encode_prompts(model, prompts_for(cfg.dataset, cfg.num_prompts), cfg.prefix_tokens)
    keep_raw = keep_raw_experts(list(cfg.systems), config)
    systems = [build_system(name, model, config, keep_raw) for name in cfg.systems]
    writer = open_writer(model)
    tags = {"k": config.k, "prefix_tokens": cfg.prefix_tokens}
    runnable = usable_systems(systems, writer, tags)
    sizes = [int(b) for b in cfg.experiment.batch_sizes]
    if cfg.num_prompts < max(sizes):
        print(f"warning: num_prompts={cfg.num_prompts} is below the largest batch size {max(sizes)}: larger batches "
              f"repeat prompts, so their working sets are not those of distinct requests (Figure 16 leaves them out)",
              file=sys.stderr)
    cases = [(b, d) for b in sizes for d, p in prompts.items() if not isinstance(p, str)]
    with tqdm(total=len(cases) * cfg.repeats * len(runnable), desc="batches", unit="run", file=sys.stderr) as bar:
        for dataset, texts in prompts.items():
            if isinstance(texts, str):
                for system in systems:
                    writer.add(unavailable({"system": system.name, "dataset": dataset, "prompt_id": -1, **tags},
                                           texts.removeprefix("unavailable: ")))
        warm = set()  # (system, batch size): each batch shape compiles kernels and captures graphs once
        for batch_size, dataset in cases:
            requests = [prompts[dataset][i % len(prompts[dataset])] for i in range(batch_size)]
            for repeat in range(cfg.repeats):
                key = {"dataset": dataset, "prompt_id": -1, "repeat": repeat, "batch_size": batch_size, **tags}
                warm_up(runnable, key, requests, writer, warm)
                writer.measure_link()  # once, after the first warm-ups
                run_batch_case(runnable, key, requests, cfg.max_new_tokens, writer, cfg.token_caps)
                bar.update(len(runnable))
    return header(model, config, cfg, f"batch (B = {sizes})"), SUMMARY_KEYS["batch"]


def warm_up(systems: list, key: dict, requests: list, writer: RecordWriter, warm: set) -> None:
    """A short unrecorded run of each system that has this case to do and has not run this batch size yet."""
    for system in systems:
        if (system.name, key["batch_size"]) not in warm and not writer.done({**key, "system": system.name}):
            warm.add((system.name, key["batch_size"]))
            system.generate(requests, WARMUP_TOKENS)


def usable_systems(systems: list, writer: RecordWriter, tags: dict) -> list:
    """The systems that can run here and decode batches; a reason row for each of the others."""
    usable = []
    for system in systems:
        ok, reason = system.available()
        if ok and not getattr(system, "batch_mode", False):
            ok, reason = False, NO_BATCH_MODE
        if ok:
            usable.append(system)
        else:
            writer.add(unavailable({"system": system.name, "dataset": "*", "prompt_id": -1, **tags}, reason))
    return usable


def run_batch_case(systems: list, key: dict, requests: list[torch.Tensor], max_new_tokens: int,
                   writer: RecordWriter, token_caps: dict | None = None) -> None:
    """One batch on every system, each row written as soon as it is measured (a cut run keeps it);
    target-only goes first, and each other system's tokens are checked against (the same prefix of)
    its batch. `token_caps`: system -> fewer tokens per request for very slow systems."""
    caps, reference = token_caps or {}, None
    for system in sorted(systems, key=lambda s: s.name != "target_only"):
        if writer.done({**key, "system": system.name}):
            continue
        batch = system.generate(requests, min(max_new_tokens, int(caps.get(system.name) or max_new_tokens)))
        is_reference = system.name == "target_only"
        reference = batch if is_reference else reference
        writer.add(batch_row({**key, "system": system.name}, batch, None if is_reference else reference,
                             writer.h2d_gbps))


def batch_row(key: dict, batch: list[GenerationResult], reference: list[GenerationResult] | None,
              h2d_gbps: float | None = None) -> dict:
    """One row per batch: mean TPOT over requests, throughput, mean acceptance, working set, H2D (decoding's
    bytes over every request's tokens after its first, the batch's shared stats) and its I/O floor."""
    stats = batch[0].stats
    row = record(key, GenerationResult([], stats), None, h2d_gbps)
    mean = lambda values: sum(values) / len(values) if values else math.nan  # noqa: E731
    row.update(tpot_ms=stats["mean_tpot_ms"], throughput_tok_s=stats["throughput_tok_s"],
               generated_tokens=sum(r.stats["generated_tokens"] for r in batch),
               acceptance_rate=mean([r.stats["acceptance_rate"] for r in batch if "acceptance_rate" in r.stats]),
               working_set_mean=mean(stats.get("window_working_sets", [])))
    if reference is not None:
        same = all(r.token_ids == ref.token_ids[: len(r.token_ids)] for r, ref in zip(batch, reference))
        row["tokens_match_target"] = "yes" if same else "no"
    return row
