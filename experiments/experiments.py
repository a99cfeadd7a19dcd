"""The paper's experiments: main comparison, speculation depth, prefix length, routing diversity, kernel."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from baselines.target_only import TargetOnly
from experiments.batch import run_batch
from experiments.datasets import prompts_for
from experiments.protocol import encode_prompts, run_cases
from experiments.records import SUMMARY_KEYS
from experiments.routing import run_routing
from experiments.run_model import keep_raw_experts, load, load_run, reads_raw_experts
from experiments.settings import header, specter_config, workload
from experiments.systems import build_system
from specter.errors import SpecterError

ROOT = Path(__file__).resolve().parent.parent


def run_main(cfg, out_dir: Path, open_writer):
    """Every configured system on every dataset's prompts (Figure 14); where the host cannot hold the raw experts
    and their residual blobs at once, the systems reading raw experts first, then the others (`HostPlan`)."""
    start = time.perf_counter()
    model, config, plan = load_run(cfg)
    loaded = time.perf_counter()
    prompts = encode_prompts(model, prompts_for(cfg.dataset, cfg.num_prompts), cfg.prefix_tokens)
    phases = main_phases(list(cfg.systems), config, plan)
    writer, references = None, {}
    for number, names in enumerate(phases):
        systems = [build_system(name, model, config, plan.keep_raw and number == 0) for name in names]
        writer = writer or open_writer(model)  # once the first systems are built: a bad name writes nothing
        built = f"systems built in {time.perf_counter() - loaded:.1f} s"
        print(f"setup: model loaded in {loaded - start:.1f} s, {built}" if number == 0 else
              f"phase {number + 1} ({'+'.join(names)}): {built}", file=sys.stderr, flush=True)
        replay = None if number == 0 else \
            TargetOnly(model, config.resident_experts_per_layer, residual=True)  # target-only's replay, from blobs
        run_cases(systems, prompts, cfg.repeats, cfg.max_new_tokens, writer, cfg.strict,
                  tags={"k": config.k, "prefix_tokens": cfg.prefix_tokens}, token_caps=cfg.token_caps,
                  warmup_tokens=cfg.warmup_tokens, references=references, reference_target=replay)
        del systems, replay
        loaded = time.perf_counter()
    note = "" if len(phases) == 1 else (f"; measured one after another, {' then '.join('+'.join(p) for p in phases)}"
                                        f" (the host cannot hold the raw experts and their residual blobs at once)")
    return header(model, config, cfg, "main") + note, SUMMARY_KEYS["main"]


def main_phases(names: list[str], config, plan) -> list[list[str]]:
    """The systems in one group, or (`plan.phased`) those that read raw experts, then those that read blobs."""
    if not plan.phased:
        return [names]
    raw = [name for name in names if reads_raw_experts(name, config)]
    return [raw, [name for name in names if name not in raw]]


def run_depth(cfg, out_dir: Path, open_writer):
    """TPOT of Specter for each K (Figure 7); the best K by mean TPOT is saved for k=auto."""
    model, config = load(cfg)
    prompts = encode_prompts(model, prompts_for(cfg.dataset, cfg.num_prompts), cfg.prefix_tokens)
    writer = open_writer(model)
    ks = list(cfg.experiment.k_values)
    for repeat in range(cfg.repeats):
        for k in ks[repeat % len(ks):] + ks[: repeat % len(ks)]:  # candidate order rotated per repeat
            config_k = specter_config(cfg, model.spec, k=k)
            engine = build_system("specter", model, config_k, keep_raw=not config.residual_transfer)  # Specter alone
            run_cases([engine], prompts, 1, cfg.max_new_tokens, writer,
                      tags={"k": k, "prefix_tokens": cfg.prefix_tokens}, repeat_offset=repeat,
                      warmup_tokens=cfg.warmup_tokens)
    best = best_k(writer.rows)
    (out_dir / "best_k.json").write_text(json.dumps({"model": model.spec.name, "mem": cfg.mem.name, "best_k": best,
                                                     "workload": workload(cfg)}))
    best_config = dataclasses.replace(config, k=best)  # the header's K is the profile's answer
    return header(model, best_config, cfg, f"depth (K in {ks}, best K = {best})"), SUMMARY_KEYS["depth"]


def best_k(rows: list[dict]) -> int:
    """The K with the lowest mean TPOT over the measured rows."""
    tpot: dict[int, list[float]] = {}
    for row in rows:
        if row.get("status") == "ok":
            tpot.setdefault(int(row["k"]), []).append(float(row["tpot_ms"]))
    if not tpot:
        raise SpecterError("the depth profile measured nothing: every dataset was unavailable (see records.csv)")
    return min(tpot, key=lambda k: sum(tpot[k]) / len(tpot[k]))


def run_prefix(cfg, out_dir: Path, open_writer):
    """Specter and the other systems for each prompt-prefix length."""
    model, config = load(cfg)
    texts = prompts_for(cfg.dataset, cfg.num_prompts)
    keep_raw = keep_raw_experts(list(cfg.systems), config)
    systems = [build_system(name, model, config, keep_raw) for name in cfg.systems]
    writer = open_writer(model)
    for prefix in cfg.experiment.prefix_values:
        prompts = encode_prompts(model, texts, int(prefix))
        run_cases(systems, prompts, cfg.repeats, cfg.max_new_tokens, writer, cfg.strict,
                  tags={"k": config.k, "prefix_tokens": int(prefix)}, token_caps=cfg.token_caps,
                  warmup_tokens=cfg.warmup_tokens)
    return header(model, config, cfg, "prefix"), SUMMARY_KEYS["prefix"]


def run_kernel(cfg, out_dir: Path, open_writer):
    """The fused INT4 kernel benchmark (Figures 10/11): a CUDA measurement, so unavailable elsewhere."""
    writer = open_writer()
    if not torch.cuda.is_available():
        writer.add({"system": "fused_int4", "dataset": "-", "prompt_id": -1,
                    "status": "unavailable: the kernel benchmark times Triton kernels on a CUDA GPU"})
        return "kernel: no CUDA device", SUMMARY_KEYS["kernel"]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_kernel.py"), "--out", str(out_dir)]
    subprocess.run(cmd, check=True)
    return f"kernel: table in {out_dir / 'kernel.csv'}", SUMMARY_KEYS["kernel"]


EXPERIMENTS = {"main": run_main, "depth": run_depth, "prefix": run_prefix, "routing": run_routing,
               "kernel": run_kernel, "batch": run_batch}
