"""Offload benchmark (GPU): target-only, the paper's design and Specter's default on one offloaded model, side by side.

    python benchmarks/bench_offload.py --models dsv2 qwen --mem high --prompts 2 --new-tokens 128 [--k 16 32] --out DIR
    python benchmarks/bench_offload.py --models dsv2 --mem low --weights calibrated --quick --variants prefetch=false

Per model it builds full-size seeded weights (`--weights synthetic`, the default, or `calibrated`) in
load_model's default dtype (bf16) or `--dtype`, cuts the built-in prompts to 16
tokens, and decodes each prompt with: target-only with every expert resident (the token reference);
target-only on demand through the mem preset's slots; `specter_paper` (SpecterConfig.paper(): no
draft_compile, draft-ahead, residual transfer or pooled slots); `specter` (SpecterConfig's defaults); one
Specter per `--variants` entry (SpecterConfig options over the defaults, e.g. `prefetch=false,eviction=popularity`;
a leading `paper` starts from the paper's design: `paper,prefetch=false`). `--quick` leaves out target-only
on demand. K is `--k`, else the model's depth-profiled K for the memory setting. Every system first decodes
one warm-up, the first paper and default Specter systems decode every prompt once untimed, and every timed
decode runs with the cyclic GC paused.

Each row is printed and appended to DIR/offload.csv as it is measured (with the commit, host and workload),
then a table per model. A row has TPOT, acceptance, hit rate, decoding's H2D MB per committed token and the
copies' GB/s, waits, the I/O floor (those bytes at the one pinned H2D bandwidth measured at the start, the
harness's definition: specter.metrics), decoding's bytes over the window misses' (routed experts not
resident when their verify window started), copy-stream idle time per phase, the mechanisms that ran, and whether the tokens equal the resident target's; Specter's row has its
TPOT over the paper design's (`tpot_over_paper`), a variant's its TPOT over Specter's (`tpot_over_specter`).
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
from benchmarks.row_log import RowLog  # noqa: E402
from experiments.machine import load_note, machine_state  # noqa: E402
from specter.config import PAPER_DESIGN  # noqa: E402
from specter.metrics import gc_paused, io_floor_ms  # noqa: E402
from specter.offload.pinned import measure_link  # noqa: E402
from specter.offload.runtime import offload_experts  # noqa: E402

PROMPTS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
           "The tower is 324 metres tall, about the same height as an 81-storey building.",
           "Robert Boulter is an English film , television and theatre actor ."]
PAPER = PAPER_DESIGN  # SpecterConfig.paper()'s fields
WARMUP_TOKENS = 40  # several full windows at K <= 16: the first measured system pays no first-use costs


def paper_config(**fields) -> specter.SpecterConfig:
    """SpecterConfig.paper(**fields): the paper's design, `fields` over it."""
    return specter.SpecterConfig.paper(**fields)


def default_k(spec, mem: str) -> int:
    """The model's depth-profiled K for memory setting `mem` (ModelSpec.k_for), else its default K."""
    return spec.k_for(spec.mem_presets.get(mem))


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
    """Untimed: the first `specter_paper*` and `specter*` systems decode every prompt in full once, so that what
    compiles or allocates on first use (Triton specialisations of the verify and decode kernels for new shapes,
    the compiled draft step) is not charged to the first measured row. Timed decodes also run with the GC
    paused (`gc_paused`)."""
    t0 = time.time()
    firsts = {}
    for label, system in systems:
        if isinstance(system, specter.SpecterEngine):
            firsts.setdefault(label.startswith("specter_paper"), system)
    for system in firsts.values():
        for ids in prompts:
            system.generate(ids, new_tokens)
    print(f"   first-use warm-up: {time.time() - t0:.0f} s", flush=True)


def mechanisms_text(mechanisms) -> str | None:
    """stats["mechanisms"] ({name: "on" | "off: why"}) as `name=on; name=off: why`."""
    if not isinstance(mechanisms, dict):
        return mechanisms
    return "; ".join(f"{name}={state}" for name, state in mechanisms.items())


def summarize(name: str, runs: list[dict], reference: list[list[int]], h2d_gbps: float | None = None) -> dict:
    """One system's row over its decodes `runs`; `h2d_gbps`: the run's one bandwidth, for the I/O floor."""
    mean = lambda key: sum(r.get(key, float("nan")) for r in runs) / len(runs)  # noqa: E731
    per = lambda key, by: mean(key) / mean(by) if mean(by) else float("nan")  # target-only has no windows
    per_token = lambda key: mean(key) / mean("generated_tokens")  # noqa: E731
    decode_bytes = (sum(r["decode_h2d_bytes"] for r in runs) / sum(r["generated_tokens"] - 1 for r in runs)
                    if "decode_h2d_bytes" in runs[0] else float("nan"))  # per token after the first, as TPOT
    return {
        "system": name, "tpot_ms": mean("tpot_ms"), "ttft_ms": mean("ttft_ms"),
        "tpot_min_ms": min(r["tpot_ms"] for r in runs), "tpot_max_ms": max(r["tpot_ms"] for r in runs),
        "acceptance": mean("acceptance_rate"), "mean_accepted": mean("mean_accepted_length"),
        "hit_rate": mean("hit_rate"),
        "planned_miss_share": mean("misses_planned") / mean("misses") if runs[0].get("misses") else float("nan"),
        "wasted_loads": mean("wasted_loads"), "loads_ahead": mean("loads_ahead"),
        "decode_h2d_mb_per_token": decode_bytes / 1e6,
        "prefill_h2d_mb": mean("prefill_h2d_bytes") / 1e6,
        "bytes_over_window_misses": (sum(r["decode_h2d_bytes"] for r in runs)
                                     / sum(r["window_miss_bytes"] for r in runs)
                                     if runs[0].get("window_miss_bytes") else None),
        "h2d_gbps": mean("h2d_gbps"),
        "residual_decode_ms_per_token": per_token("residual_decode_ms"),
        "residual_group_host_ms_per_token": per_token("residual_group_host_ms"),
        "residual_decodes_per_token": per_token("residual_decodes"),
        "upload_wait_ms_per_token": per_token("upload_wait_ms"),
        "stream_waits_skipped_per_token": per_token("stream_waits_skipped"),
        "verify_waves_per_token": per_token("verify_waves"),
        "h2d_copy_calls_per_token": per_token("h2d_copy_calls"),
        "h2d_copies_per_token": per_token("h2d_copies"),
        "wait_ms_per_token": per_token("wait_ms"),
        "moe_host_ms_per_token": (mean("verify_host_ms") - mean("verify_host_wait_ms")) / mean("generated_tokens"),
        "moe_host_load_ms_per_token": per_token("verify_host_load_ms"),
        "moe_host_wave_ms_per_token": per_token("verify_host_wave_ms"),
        "draft_ms_per_token": per_token("draft_ms"),
        "draft_step_ms": mean("draft_ms") / mean("draft_tokens") if runs[0].get("draft_tokens") else float("nan"),
        "draft_graph": runs[0].get("draft_graph"),
        "verify_ms_per_token": per_token("verify_ms"),
        "ahead_launch_host_ms_per_token": per_token("draft_ahead_launch_host_ms"),
        "windows_drafted_ahead": per("draft_ahead_windows", "iterations"),
        "first_windows_from_prompt": mean("draft_ahead_prompt_windows"),
        "prefetch_precision": mean("prefetch_precision"), "prefetch_recall": mean("prefetch_recall"),
        "io_floor_ms": io_floor_ms(decode_bytes, h2d_gbps),
        **{f"copy_idle_{phase}_ms_per_token": per_token(f"copy_idle_{phase}_ms")
           for phase in ("draft", "verify", "between")},
        **{f"copy_gap_{cause}_ms_per_token": per_token(f"copy_gap_{cause}_ms") for cause in ("slot", "host")},
        "mechanisms": mechanisms_text(runs[0].get("mechanisms")),
        "tokens_match_resident": sum(r["tokens"] == reference[i % len(reference)]  # runs repeat the prompts
                                     for i, r in enumerate(runs)) / len(runs),
    }


def parse_variant(text: str) -> dict:
    """'eviction=popularity,prefetch=false' -> SpecterConfig options (numbers and true/false where they parse as
    one); a leading 'paper' adds the paper design's options first ('paper,prefetch=false')."""
    items = text.split(",")
    base = PAPER if items[0] == "paper" else {}
    try:
        pairs = [item.split("=") for item in items[1 if base else 0:]]
        return {**base, **{key: _number_or_text(value) for key, value in pairs}}
    except ValueError:
        sys.exit(f"error: --variants takes [paper,]key=value[,key=value], got {text!r}")


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
    variants: tuple = ()
    quick: bool = False
    profile_to: Path | None = None
    weights: str = "synthetic"
    dtype: torch.dtype | None = None
    repeats: int = 1
    interleave: bool = False
    h2d_gbps: float | None = None  # the run's one pinned H2D bandwidth (every row's I/O floor)


def bench_model(name: str, options: BenchOptions, log: RowLog | None = None) -> list[dict]:
    """Every system's row on model `name`, each appended to `log` as it is measured."""
    t0 = time.time()
    model = specter.load_model(name, weights=options.weights, device="cuda", dtype=options.dtype)
    slots, ks = model.spec.mem_presets[options.mem], options.ks or [default_k(model.spec, options.mem)]
    prompts = [torch.tensor([model.tokenizer(p)["input_ids"][:16]]) for p in PROMPTS[:options.num_prompts]]
    dtype = str(model.dtype).removeprefix("torch.")
    print(f"\n== {name} ({options.weights} weights, {dtype}): built in {time.time() - t0:.0f} s; K={ks[0]}, {slots} "
          f"resident experts/layer ({options.mem}), {options.num_prompts} prompts x {options.new_tokens} "
          f"tokens{load_note({**machine_state('cuda'), 'h2d_gbps': options.h2d_gbps})}", flush=True)
    tags = {"model": name, "weights": options.weights, "mem": options.mem, "slots": slots}
    workload = (f"{name} {options.weights} {dtype} mem={options.mem} slots={slots} prompts={options.num_prompts}x"
                f"{options.new_tokens} repeats={options.repeats}{' interleaved' if options.interleave else ''}")
    record = (lambda row: log.add(row, workload)) if log is not None else (lambda row: row)
    resident = run(TargetOnly(model), prompts, options.new_tokens)
    reference = [r["tokens"] for r in resident]
    rows = [record({**summarize("target_only_resident", resident, reference), **tags, "k": None})]
    offload_experts(model, slots)
    systems, compare = build_systems(model, slots, ks, options)
    warm_up_first_use(systems, prompts, options.new_tokens)
    rows += measure(systems, compare, prompts, reference, options, lambda row: record({**row, **tags}))
    for label, system in systems if options.profile_to is not None else []:
        if isinstance(system, specter.SpecterEngine):
            print(f"   host profile: {label}", flush=True)
            safe_label = re.sub(r"[^A-Za-z0-9_.-]+", "_", label)  # a variant's label holds '=' and ','
            host_profile(system, prompts[0], options.new_tokens,
                         options.profile_to / f"host_profile_{name}_{safe_label}.txt")
    del model, systems
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def build_systems(model, slots: int, ks: list[int], options: BenchOptions) -> tuple[list, dict]:
    """[(label, system)] to measure, and {label: (the label it is compared with, the ratio's column)}."""
    def config(k_i: int, **settings) -> specter.SpecterConfig:  # a variant may set its own slots
        return specter.SpecterConfig(**{"k": k_i, "resident_experts_per_layer": slots, **settings})

    systems, compare = [] if options.quick else [("target_only_offload", TargetOnly(model, slots))], {}
    for k_i in ks:
        suffix = "" if len(ks) == 1 else f"_k{k_i}"
        paper = paper_config(k=k_i, resident_experts_per_layer=slots)
        systems.append((f"specter_paper{suffix}", specter.SpecterEngine(model, paper)))
        systems.append((f"specter{suffix}", specter.SpecterEngine(model, config(k_i))))
        compare[f"specter{suffix}"] = (f"specter_paper{suffix}", "tpot_over_paper")
        for v in options.variants:
            systems.append((f"specter_{v}{suffix}", specter.SpecterEngine(model, config(k_i, **parse_variant(v)))))
            compare[systems[-1][0]] = (f"specter{suffix}", "tpot_over_specter")
    return systems, compare


def measure(systems: list, compare: dict, prompts, reference: list, options: BenchOptions, record=None) -> list[dict]:
    """A row per system, each printed and passed to `record` as it is measured (all at the end with
    `interleave`); Specter's row carries its TPOT over the paper design's (`tpot_over_paper`), a variant's its
    TPOT over Specter's (`tpot_over_specter`)."""
    t0 = time.time()
    timed = run_interleaved(systems, prompts, options.new_tokens, options.repeats) if options.interleave else {}
    rows = {}
    for label, system in systems:
        t1 = time.time()
        runs = timed[label] if timed else run(system, prompts, options.new_tokens, options.repeats)
        row = summarize(label, runs, reference, options.h2d_gbps)
        row["k"] = system.config.k if hasattr(system, "config") else None
        base_label, column = compare.get(label, (None, None))
        base = rows.get(base_label)
        row["tpot_over_paper"] = row["tpot_over_specter"] = None
        if base:
            row[column] = row["tpot_ms"] / base["tpot_ms"]
        rows[label] = record(row) if record is not None else row
        versus = f"; {row[column]:.3f}x {base['system']}'s TPOT" if base else ""
        took = f"{time.time() - t1:.0f} s" if not timed else f"interleaved, {time.time() - t0:.0f} s in all"
        print(f"   {label}: {took}; {row_line(row)}{versus}", flush=True)  # kept if a call is cut
    return list(rows.values())


def row_line(row: dict) -> str:
    """TPOT, and for Specter the I/O floor ratio and where the copy stream idled, on one line."""
    line = f"TPOT {row['tpot_ms']:.2f} ms ({row['tpot_min_ms']:.2f}-{row['tpot_max_ms']:.2f})"
    if row.get("io_floor_ms") == row.get("io_floor_ms") and row.get("bytes_over_window_misses"):  # floor not NaN
        idle = ", ".join(f"{p} {row[f'copy_idle_{p}_ms_per_token']:.2f}" for p in ("draft", "verify", "between"))
        line += (f", TPOT / I/O floor {row['tpot_ms'] / row['io_floor_ms']:.2f}, decoding's "
                 f"H2D {row['decode_h2d_mb_per_token']:.0f} MB/token ({row['bytes_over_window_misses']:.2f}x the "
                 f"window misses' bytes), copy idle ms/token: {idle}")
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
    if row.get("mechanisms"):
        line += f"; mechanisms: {row['mechanisms']}"
    return line


def print_table(rows: list[dict]) -> None:
    cols = ["system", "k", "tpot_ms", "acceptance", "hit_rate", "planned_miss_share", "decode_h2d_mb_per_token",
            "h2d_gbps", "residual_decode_ms_per_token", "wait_ms_per_token", "moe_host_ms_per_token",
            "draft_step_ms", "verify_ms_per_token", "prefetch_precision", "io_floor_ms",
            "tpot_over_paper", "tpot_over_specter", "tokens_match_resident"]
    print(" | ".join(f"{c:>22}" if i == 0 else f"{c[:12]:>12}" for i, c in enumerate(cols)))
    for r in rows:
        cells = [f"{r['system']:>22}"]
        for c in cols[1:]:
            v = r.get(c)
            cells.append(f"{v:12.3f}" if isinstance(v, float) else f"{str(v):>12}")
        print(" | ".join(cells))
    base = next((r for r in rows if r["system"] == "target_only_offload"), None)
    for spec in (r for r in rows if r["system"].startswith("specter")):
        versus = f"{base['tpot_ms'] / spec['tpot_ms']:.2f}x TPOT vs target-only (same cache); " if base else ""
        if spec.get("tpot_over_paper"):
            versus += f"{spec['tpot_over_paper']:.3f}x the paper design's TPOT; "
        if spec.get("tpot_over_specter"):
            versus += f"{spec['tpot_over_specter']:.3f}x Specter's TPOT; "
        idle = ", ".join(f"{p} {spec[f'copy_idle_{p}_ms_per_token']:.2f}" for p in ("draft", "verify", "between"))
        floor = spec["io_floor_ms"]
        ratio = f"{spec['tpot_ms'] / floor:.2f}" if floor == floor else "-"
        print(f"{spec['system']}: {versus}TPOT / I/O floor: {ratio}; copy stream idle ms/token: {idle}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["dsv2", "qwen"])
    parser.add_argument("--mem", default="high")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, nargs="*", help="speculation depths for Specter (default: the model's "
                        "depth-profiled K for --mem)")
    parser.add_argument("--variants", nargs="*", default=[],
                        help="more Specter configurations over the defaults, e.g. prefetch=false "
                             "paper,eviction=popularity")
    parser.add_argument("--quick", action="store_true", help="leave out target-only on demand")
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
                        help="default: load_model's (bfloat16, what the real checkpoints store)")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    if args.repeats < 1:
        sys.exit(f"error: --repeats must be at least 1, got {args.repeats}")
    if "paper" in args.variants or len(set(args.variants)) < len(args.variants):
        sys.exit("error: --variants repeats a system (the paper's design, specter_paper, is always measured)")
    if not torch.cuda.is_available():
        sys.exit("error: bench_offload.py needs a CUDA GPU")
    options = BenchOptions(args.mem, args.prompts, args.new_tokens, args.k, tuple(args.variants), args.quick,
                           args.out if args.host_profile else None, args.weights,
                           args.dtype and getattr(torch, args.dtype), args.repeats, args.interleave,
                           measure_link("cuda").max_gbps)
    print(f"pinned H2D bandwidth, measured once for every row's I/O floor (max of 10 trials of 1 GiB): "
          f"{options.h2d_gbps} GB/s", flush=True)
    log = RowLog(args.out / "offload.csv")
    for name in args.models:
        print_table(bench_model(name, options, log))
    print(f"rows in {log.path}")


if __name__ == "__main__":
    main()
