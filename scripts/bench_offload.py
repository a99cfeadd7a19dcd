"""Offload benchmark (GPU): target-only and Specter variants on one offloaded model, side by side.

    python scripts/bench_offload.py --models dsv2 qwen --mem high --prompts 2 --new-tokens 128 [--k 4 16] --out DIR
    python scripts/bench_offload.py --models dsv2 --k 8 --quick --variants spare_rows=0 initial_chunk=2 --out DIR

Per model it builds full-size seeded weights (`--weights synthetic`, the default, or `calibrated`) in
load_model's default dtype (bf16; calibrated weights fp16) or `--dtype`, cuts the built-in prompts to 16
tokens, and decodes each prompt with:
target-only with every expert resident (the token reference); target-only on demand through the mem
preset's slots; Specter without prefetch; Specter; one Specter per `--variants` entry (SpecterConfig
options, e.g. `eviction=popularity,initial_chunk=2`); Specter with an eager draft. `--quick` keeps only the
resident reference, Specter and the variants. Every system first decodes one warm-up, the first Specter
system decodes every prompt once untimed, and every timed decode runs with the cyclic GC paused.

Each row is printed as it is measured, then a table per model; all rows go to DIR/offload.csv. A row has
TPOT, acceptance, hit rate, H2D MB per token and GB/s, waits, the I/O floor (the bytes of routed experts
that were not resident when their verify window started, at the run's measured H2D bandwidth, per
committed token), decoding's bytes over the floor, copy-stream idle time per phase, and whether the tokens
equal the resident target's; a variant's row also has its TPOT over Specter's (`tpot_over_specter`).
`--repeats N` decodes every prompt N times per system (TPOT min and max over all of them); with
`--interleave` the systems take turns, each decoding every prompt once per round, N rounds (a slow spell of
the host then falls on every system alike). `--host-profile` writes a cProfile of one more decode of each
Specter system. Reference results: results/reference/NOTES.md.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import specter  # noqa: E402
from baselines.target_only import TargetOnly  # noqa: E402
from experiments.machine import load_note, machine_state  # noqa: E402
from specter.metrics import gc_paused, write_rows_csv  # noqa: E402
from specter.offload.runtime import offload_experts  # noqa: E402
from specter.window_accounting import floor_with_host  # noqa: E402

PROMPTS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
           "The tower is 324 metres tall, about the same height as an 81-storey building.",
           "Robert Boulter is an English film , television and theatre actor ."]


WARMUP_TOKENS = 40  # several full windows at K <= 16: the first measured system pays no first-use costs


def run(system, prompts, new_tokens: int, repeats: int = 1) -> list[dict]:
    """One warm-up, then every prompt in turn, `repeats` times over; stats plus the tokens, prompt order
    within each repeat."""
    system.generate(prompts[0], min(new_tokens, WARMUP_TOKENS))
    return [run for _ in range(repeats) for run in decode_prompts(system, prompts, new_tokens)]


def run_interleaved(systems: list, prompts, new_tokens: int, repeats: int) -> dict[str, list[dict]]:
    """`run` for every (label, system) of `systems` in rounds: each system's warm-up, then `repeats` rounds in
    which each system in turn decodes every prompt, so that a slow spell of the host falls on all of them
    alike. Label -> its runs, as `run` returns them."""
    for _, system in systems:
        system.generate(prompts[0], min(new_tokens, WARMUP_TOKENS))
    runs = {label: [] for label, _ in systems}
    for _ in range(repeats):
        for label, system in systems:
            runs[label] += decode_prompts(system, prompts, new_tokens)
    return runs


def decode_prompts(system, prompts, new_tokens: int) -> list[dict]:
    """One timed decode of each prompt (the cyclic GC paused): stats plus the tokens."""
    results = []
    for ids in prompts:
        with gc_paused():
            results.append(system.generate(ids, new_tokens))
    return [dict(r.stats, tokens=r.token_ids) for r in results]


def warm_up_first_use(systems: list, prompts, new_tokens: int) -> None:
    """Untimed: the first Specter system decodes every prompt in full once, so that what compiles or
    allocates on first use (Triton specialisations of the verify kernels for new shapes) is not charged to
    the first measured row. Timed decodes also run with the GC paused (`gc_paused`)."""
    t0 = time.time()
    first = next((system for _, system in systems if isinstance(system, specter.SpecterEngine)), None)
    for ids in prompts if first is not None else []:
        first.generate(ids, new_tokens)
    print(f"   first-use warm-up: {time.time() - t0:.0f} s", flush=True)


def summarize(name: str, runs: list[dict], reference: list[list[int]]) -> dict:
    mean = lambda key: sum(r.get(key, float("nan")) for r in runs) / len(runs)  # noqa: E731
    per = lambda key, by: mean(key) / mean(by) if mean(by) else float("nan")  # target-only has no windows
    tokens = sum(r["generated_tokens"] for r in runs)
    floor = None
    if "io_floor_bytes" in runs[0]:
        bytes_per_ms = sum(r["h2d_bytes"] for r in runs) / sum(r["h2d_busy_ms"] for r in runs)
        floor = sum(r["io_floor_bytes"] for r in runs) / bytes_per_ms / tokens
    return {
        "io_floor_both_paths_ms_per_token": floor_with_host(floor, runs[0], bytes_per_ms) if floor else None,
        "system": name, "tpot_ms": mean("tpot_ms"), "ttft_ms": mean("ttft_ms"),
        "tpot_min_ms": min(r["tpot_ms"] for r in runs), "tpot_max_ms": max(r["tpot_ms"] for r in runs),
        "acceptance": mean("acceptance_rate"), "mean_accepted": mean("mean_accepted_length"),
        "hit_rate": mean("hit_rate"),
        "planned_miss_share": mean("misses_planned") / mean("misses") if runs[0].get("misses") else float("nan"),
        "wasted_loads": mean("wasted_loads"), "loads_ahead": mean("loads_ahead"),
        "h2d_mb_per_token": mean("h2d_bytes_per_token") / 1e6,
        "decode_h2d_mb_per_token": mean("decode_h2d_bytes") / mean("generated_tokens") / 1e6,
        "bytes_over_floor": (sum(r["decode_h2d_bytes"] for r in runs) / sum(r["io_floor_bytes"] for r in runs)
                             if "io_floor_bytes" in runs[0] else None),
        "h2d_gbps": mean("h2d_gbps"),
        "residual_decode_ms_per_token": mean("residual_decode_ms") / mean("generated_tokens"),
        "residual_group_host_ms_per_token": mean("residual_group_host_ms") / mean("generated_tokens"),
        "residual_decodes_per_token": mean("residual_decodes") / mean("generated_tokens"),
        "upload_wait_ms_per_token": mean("upload_wait_ms") / mean("generated_tokens"),
        "stream_waits_skipped_per_token": mean("stream_waits_skipped") / mean("generated_tokens"),
        "verify_waves_per_token": mean("verify_waves") / mean("generated_tokens"),
        "h2d_copy_calls_per_token": mean("h2d_copy_calls") / mean("generated_tokens"),
        "h2d_copies_per_token": mean("h2d_copies") / mean("generated_tokens"),
        "host_expert_runs_per_token": mean("host_expert_runs") / mean("generated_tokens"),
        "host_expert_mb_per_token": mean("host_expert_bytes") / mean("generated_tokens") / 1e6,
        "host_expert_cost": runs[0].get("host_expert_cost"),
        "wait_ms_per_token": mean("wait_ms") / mean("generated_tokens"),
        "moe_host_ms_per_token": (mean("verify_host_ms") - mean("verify_host_wait_ms")) / mean("generated_tokens"),
        "moe_host_load_ms_per_token": mean("verify_host_load_ms") / mean("generated_tokens"),
        "moe_host_wave_ms_per_token": mean("verify_host_wave_ms") / mean("generated_tokens"),
        "draft_ms_per_token": mean("draft_ms") / mean("generated_tokens"),
        "draft_step_ms": mean("draft_ms") / mean("draft_tokens") if runs[0].get("draft_tokens") else float("nan"),
        "draft_graph": runs[0].get("draft_graph"),
        "verify_ms_per_token": mean("verify_ms") / mean("generated_tokens"),
        "ahead_launch_host_ms_per_token": mean("draft_ahead_launch_host_ms") / mean("generated_tokens"),
        "windows_drafted_ahead": per("draft_ahead_windows", "iterations"),
        "windows_drafted_by_branch": per("draft_branch_windows", "iterations"),
        "first_windows_from_prompt": mean("draft_ahead_prompt_windows"),
        "prefetch_precision": mean("prefetch_precision"), "prefetch_recall": mean("prefetch_recall"),
        "io_floor_ms_per_token": floor,
        **{f"copy_idle_{phase}_ms_per_token": mean(f"copy_idle_{phase}_ms") / mean("generated_tokens")
           for phase in ("draft", "verify", "between")},
        **{f"copy_gap_{cause}_ms_per_token": mean(f"copy_gap_{cause}_ms") / mean("generated_tokens")
           for cause in ("slot", "host")},
        "tokens_match_resident": sum(r["tokens"] == reference[i % len(reference)]  # runs repeat the prompts
                                     for i, r in enumerate(runs)) / len(runs),
    }


def parse_variant(text: str) -> dict:
    """'initial_chunk=1,eviction=popularity,prefetch=false' -> SpecterConfig options (numbers and true/false
    where they parse as one)."""
    try:
        pairs = [item.split("=") for item in text.split(",")]
        return {key: _number_or_text(value) for key, value in pairs}
    except ValueError:
        sys.exit(f"error: --variants takes key=value[,key=value], got {text!r}")


def _number_or_text(value: str) -> bool | int | float | str:
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def host_profile(system, prompt: torch.Tensor, new_tokens: int, path: Path, top: int = 30) -> None:
    """One more generate() under cProfile: the host functions by own time, then who called each host wait
    (`synchronize`: an upload ring's buffer, a host read, a stream), to `path` (and the top 12 printed)."""
    profiler = cProfile.Profile()
    profiler.runcall(system.generate, prompt, new_tokens)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).sort_stats("tottime")
    stats.print_stats(top)
    stats.print_callers("synchronize")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.getvalue())
    lines = [line for line in text.getvalue().splitlines() if line.strip()]
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
    print("\n".join(lines[start: start + 13]))


@dataclass(frozen=True)
class BenchOptions:
    """What `bench_model` runs: the command line's options."""

    mem: str = "high"
    num_prompts: int = 2
    new_tokens: int = 128
    ks: list[int] | None = None
    plan_only: bool = False
    initial_chunk: int | None = None
    variants: tuple = ()
    quick: bool = False
    profile_to: Path | None = None
    weights: str = "synthetic"
    dtype: torch.dtype | None = None
    repeats: int = 1
    interleave: bool = False


def bench_model(name: str, options: BenchOptions) -> list[dict]:
    t0 = time.time()
    model = specter.load_model(name, weights=options.weights, device="cuda", dtype=options.dtype)
    slots, ks = model.spec.mem_presets[options.mem], options.ks or [model.spec.default_k]
    prompts = [torch.tensor([model.tokenizer(p)["input_ids"][:16]]) for p in PROMPTS[:options.num_prompts]]
    print(f"\n== {name} ({options.weights} weights, {str(model.dtype).removeprefix('torch.')}): built in "
          f"{time.time() - t0:.0f} s; K={ks[0]}, {slots} resident experts/layer ({options.mem}), {options.num_prompts} "
          f"prompts x {options.new_tokens} tokens{load_note(machine_state('cuda'))}", flush=True)
    resident = run(TargetOnly(model), prompts, options.new_tokens)
    reference = [r["tokens"] for r in resident]
    offload_experts(model, slots)
    systems, base_of = build_systems(model, slots, ks, options)
    warm_up_first_use(systems, prompts, options.new_tokens)
    rows = [summarize("target_only_resident", resident, reference)] + measure(systems, base_of, prompts, reference,
                                                                              options)
    for label, system in systems if options.profile_to is not None else []:
        if isinstance(system, specter.SpecterEngine):
            print(f"   host profile: {label}", flush=True)
            safe_label = re.sub(r"[^A-Za-z0-9_.-]+", "_", label)  # a variant's label holds '=' and ','
            host_profile(system, prompts[0], options.new_tokens,
                         options.profile_to / f"host_profile_{name}_{safe_label}.txt")
    for row in rows:
        row.update(model=name, weights=options.weights, mem=options.mem, slots=slots, k=row.pop("k", None) or ks[0])
    del model, systems
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def build_systems(model, slots: int, ks: list[int], options: BenchOptions) -> tuple[list, dict]:
    """[(label, system)] to measure, and {variant label: the label of the Specter it is compared with}."""
    chunk = {} if options.initial_chunk is None else {"initial_chunk": options.initial_chunk}

    def config(k_i: int, **settings) -> specter.SpecterConfig:  # a variant may set its own slots (same memory: spares)
        return specter.SpecterConfig(k=k_i, **{"resident_experts_per_layer": slots, **chunk, **settings})

    systems, base_of = [] if options.quick else [("target_only_offload", TargetOnly(model, slots))], {}
    for k_i in ks:
        suffix = "" if len(ks) == 1 else f"_k{k_i}"
        if not options.quick:
            systems.append((f"specter_no_prefetch{suffix}", specter.SpecterEngine(model, config(k_i, prefetch=False))))
        systems.append((f"specter{suffix}", specter.SpecterEngine(model, config(k_i))))
        if options.plan_only:  # no boundary inside the draft: only the verification plan (the draft's routing)
            systems.append((f"specter_plan_only{suffix}", specter.SpecterEngine(model, config(k_i, initial_chunk=k_i))))
        for v in options.variants:
            systems.append((f"specter_{v}{suffix}", specter.SpecterEngine(model, config(k_i, **parse_variant(v)))))
            base_of[systems[-1][0]] = f"specter{suffix}"
    if not options.quick:
        systems.append(("specter_eager_draft", specter.SpecterEngine(model, config(ks[0], cuda_graph=False))))
    return systems, base_of


def measure(systems: list, base_of: dict, prompts, reference: list, options: BenchOptions) -> list[dict]:
    """A row per system, each printed as it is measured (all at the end with `interleave`); a variant's row
    carries its TPOT over its Specter's (`tpot_over_specter`)."""
    t0 = time.time()
    timed = run_interleaved(systems, prompts, options.new_tokens, options.repeats) if options.interleave else {}
    rows = {}
    for label, system in systems:
        t1 = time.time()
        runs = timed[label] if timed else run(system, prompts, options.new_tokens, options.repeats)
        row = rows[label] = summarize(label, runs, reference)
        row["k"] = system.config.k if hasattr(system, "config") else None
        base = rows.get(base_of.get(label))
        row["tpot_over_specter"] = row["tpot_ms"] / base["tpot_ms"] if base else None
        versus = f"; {row['tpot_over_specter']:.3f}x {base['system']}'s TPOT" if base else ""
        took = f"{time.time() - t1:.0f} s" if not timed else f"interleaved, {time.time() - t0:.0f} s in all"
        print(f"   {label}: {took}; {row_line(row)}{versus}", flush=True)  # kept if a call is cut
    return list(rows.values())


def row_line(row: dict) -> str:
    """TPOT, and for Specter the I/O floor ratio and where the copy stream idled, on one line."""
    line = f"TPOT {row['tpot_ms']:.2f} ms ({row['tpot_min_ms']:.2f}-{row['tpot_max_ms']:.2f})"
    if row.get("io_floor_ms_per_token"):
        idle = ", ".join(f"{p} {row[f'copy_idle_{p}_ms_per_token']:.2f}" for p in ("draft", "verify", "between"))
        line += (f", TPOT / I/O floor {row['tpot_ms'] / row['io_floor_ms_per_token']:.2f}, decoding's "
                 f"H2D {row['decode_h2d_mb_per_token']:.0f} MB/token ({row['bytes_over_floor']:.2f}x the floor's "
                 f"bytes), copy idle ms/token: {idle}")
        if row.get("copy_gap_slot_ms_per_token") == row.get("copy_gap_slot_ms_per_token"):  # not NaN (GPU)
            line += (f"; waiting for a slot's reader {row['copy_gap_slot_ms_per_token']:.2f}, "
                     f"for the host {row['copy_gap_host_ms_per_token']:.2f}")
        line += (f"; host ms/token in MoE layers {row['moe_host_ms_per_token']:.2f} (loads "
                 f"{row['moe_host_load_ms_per_token']:.2f}, waves {row['moe_host_wave_ms_per_token']:.2f}: "
                 f"{row['verify_waves_per_token']:.1f}/token); decode "
                 f"launches {row['residual_decodes_per_token']:.1f}/token, group launches' host ms "
                 f"{row['residual_group_host_ms_per_token']:.2f}, upload ring waits "
                 f"{row['upload_wait_ms_per_token']:.2f}; stream waits spared "
                 f"{row['stream_waits_skipped_per_token']:.1f}/token; copy calls "
                 f"{row['h2d_copy_calls_per_token']:.1f}/token for {row['h2d_copies_per_token']:.1f} loads")
    return line


def print_table(rows: list[dict]) -> None:
    cols = ["system", "k", "tpot_ms", "acceptance", "hit_rate", "planned_miss_share", "h2d_mb_per_token",
            "h2d_gbps", "residual_decode_ms_per_token", "host_expert_runs_per_token", "wait_ms_per_token",
            "moe_host_ms_per_token", "draft_step_ms", "verify_ms_per_token", "prefetch_precision",
            "io_floor_ms_per_token", "tpot_over_specter", "tokens_match_resident"]
    print(" | ".join(f"{c:>22}" if i == 0 else f"{c[:12]:>12}" for i, c in enumerate(cols)))
    for r in rows:
        cells = [f"{r['system']:>22}"]
        for c in cols[1:]:
            v = r.get(c)
            cells.append(f"{v:12.3f}" if isinstance(v, float) else f"{str(v):>12}")
        print(" | ".join(cells))
    base = next((r for r in rows if r["system"] == "target_only_offload"), None)
    eager = next((r for r in rows if r["system"] == "specter_eager_draft"), None)
    for spec in (r for r in rows if r["system"].startswith("specter") and "no_prefetch" not in r["system"]
                 and r["system"] != "specter_eager_draft"):
        versus = f"{base['tpot_ms'] / spec['tpot_ms']:.2f}x TPOT vs target-only (same cache); " if base else ""
        if spec.get("tpot_over_specter"):
            versus += f"{spec['tpot_over_specter']:.3f}x Specter's TPOT; "
        idle = ", ".join(f"{p} {spec[f'copy_idle_{p}_ms_per_token']:.2f}" for p in ("draft", "verify", "between"))
        print(f"{spec['system']}: {versus}TPOT / I/O floor: {spec['tpot_ms'] / spec['io_floor_ms_per_token']:.2f}; "
              f"copy stream idle ms/token: {idle}")
    if eager:
        print(f"draft step: graph {spec['draft_step_ms']:.2f} ms vs eager {eager['draft_step_ms']:.2f} ms "
              f"({spec['draft_graph']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["dsv2", "qwen"])
    parser.add_argument("--mem", default="high")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, nargs="*", help="speculation depths for Specter (default: the model's)")
    parser.add_argument("--initial-chunk", type=int, help="Specter's cold-start chunk (default: SpecterConfig's)")
    parser.add_argument("--plan-only", action="store_true",
                        help="also Specter without draft-time prefetch batches, loading only on the verification plan")
    parser.add_argument("--variants", nargs="*", default=[],
                        help="more Specter configurations, e.g. initial_chunk=1 prefetch_chunk=8")
    parser.add_argument("--quick", action="store_true",
                        help="only the resident reference, Specter and the variants (no on-demand, no-prefetch, eager)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed decodes of every prompt per system (TPOT min and max show the spread)")
    parser.add_argument("--interleave", action="store_true",
                        help="decode in rounds: each system in turn decodes every prompt, --repeats rounds (a slow "
                             "spell of the host falls on every system alike; rows are printed at the end)")
    parser.add_argument("--host-profile", action="store_true",
                        help="one more generate() of each Specter system under cProfile, written to "
                             "OUT/host_profile_<model>_<system>.txt")
    parser.add_argument("--weights", choices=("synthetic", "calibrated"), default="synthetic",
                        help="seeded random weights, or calibrated ones (real routing locality and acceptance)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default=None,
                        help="default: load_model's (bfloat16, what the real checkpoints store; calibrated "
                             "weights float16)")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    if args.repeats < 1:
        sys.exit(f"error: --repeats must be at least 1, got {args.repeats}")
    if not torch.cuda.is_available():
        sys.exit("error: bench_offload.py needs a CUDA GPU")
    options = BenchOptions(args.mem, args.prompts, args.new_tokens, args.k, args.plan_only, args.initial_chunk,
                           tuple(args.variants), args.quick, args.out if args.host_profile else None, args.weights,
                           args.dtype and getattr(torch, args.dtype), args.repeats, args.interleave)
    rows = []
    for name in args.models:
        model_rows = bench_model(name, options)
        print_table(model_rows)
        rows += model_rows
    write_rows_csv(args.out / "offload.csv", rows)


if __name__ == "__main__":
    main()
