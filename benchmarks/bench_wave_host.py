"""Host cost of one verify wave on the GPU: what the host spends to enqueue a wave of W slot experts.

A verify wave (`specter.verify.residency`) waits for its experts' ready events, uploads the wave's
expert -> pool-row map and launches the slot kernel's two GEMMs over the layer's alignment. Two ways side
by side, in one process: "per_call" (the map built by `torch.tensor` in pinned memory, the launches by
`slot_moe_rows`, which checks and derives every argument per call) and "prepared", the residency manager's
(the map written into a pinned ring through numpy, `DeviceStreams.upload_map`; the launches prepared once per
layer, `slot_moe_waves`). For one routed layer of each model (seeded hidden rows and routing of a verify
window of --tokens tokens, W experts in a pool of real-size fp16 rows) this times, per wave size W and way,
the host microseconds of each of the three steps (median over --repeats waves, the GPU kept busy so the
host never waits for it, after a warm-up that fills the pinned allocator's cache as a run does) and the
GPU milliseconds per wave (CUDA events around the same waves, run back to back); the prepared rows carry
their host time over the per-call one's. A layer that needs N loads runs about N / W waves: at mem=low
(4 slots) W is 2, at mem=high (16 slots) 8. Correctness first: each way's wave rows equal the torch
reference's.

    python benchmarks/bench_wave_host.py --models dsv2 --out DIR
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.row_log import RowLog  # noqa: E402
from specter.kernels.slot_moe import (  # noqa: E402
    MoEWorkspace,
    align_routing,
    slot_moe_rows,
    slot_moe_rows_reference,
    slot_moe_waves,
)
from specter.metrics import format_row  # noqa: E402
from specter.models.registry import get_spec  # noqa: E402
from specter.offload.streams import DeviceStreams  # noqa: E402

WAVES = (1, 2, 4, 8)


def layer_shapes(name: str) -> tuple[int, int, int, int]:
    """(hidden, intermediate, experts, top-k) of `name`'s routed layer."""
    config = get_spec(name).hf_config
    experts = config.get("n_routed_experts") or config.get("num_experts") or config["num_local_experts"]
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    return config["hidden_size"], inter, experts, config["num_experts_per_tok"]


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def bench(name: str, tokens: int, repeats: int) -> list[dict]:
    hidden_size, inter, experts, k = layer_shapes(name)
    gen = torch.Generator().manual_seed(0)
    pool = (0.02 * torch.randn(max(WAVES), 3 * inter * hidden_size, generator=gen)).half().cuda()  # [S, 3IH]
    hidden = torch.randn(tokens, hidden_size, generator=gen).half().cuda()  # [T, H]
    top_k = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)]).cuda()  # [T, k]
    routed = top_k.unique().tolist()
    streams, workspace = DeviceStreams(torch.device("cuda")), MoEWorkspace()
    alignment = align_routing(top_k, experts, workspace)
    rows = torch.zeros(tokens * k, hidden_size, dtype=torch.float32, device="cuda")  # [T*k, H]
    ways = {
        "per_call": (lambda pairs: pinned_row_map(pairs, experts),
                     lambda row_of_expert: slot_moe_rows(hidden, top_k, pool, row_of_expert, inter, rows,
                                                         workspace=workspace, alignment=alignment)),
        "prepared": (lambda pairs: streams.upload_map(experts, pairs),
                     slot_moe_waves(hidden, top_k, pool, inter, rows, alignment, workspace=workspace)),
    }
    out = []
    for size in WAVES:
        expert_rows = [(expert, row) for row, expert in enumerate(routed[:size])]
        per_call = None
        for way, (row_map, launch) in ways.items():
            check_wave(hidden, top_k, pool, expert_rows, inter, row_map, launch, rows)
            time_waves(streams, expert_rows, row_map, launch, repeats)  # warm-up: pinned blocks for the row maps
            torch.cuda.synchronize()
            torch.cuda._sleep(int(2e9))  # about a second of GPU work: no step below waits for the GPU
            spans, gpu_ms = time_waves(streams, expert_rows, row_map, launch, repeats)
            host = {f"host_us_{key}": round(median(values), 1) for key, values in spans.items()}
            total = round(sum(host.values()), 1)
            per_call = per_call or total
            out.append({"model": name, "tokens": tokens, "wave": size, "way": way, **host,
                        "host_us_per_wave": total, "host_over_per_call": round(total / per_call, 3),
                        "gpu_ms_per_wave": round(gpu_ms, 4)})
    return out


def pinned_row_map(expert_rows: list, experts: int) -> torch.Tensor:
    """The per-call way's map: a host list to a fresh pinned tensor, copied to the GPU."""
    row_map = [-1] * experts
    for expert, row in expert_rows:
        row_map[expert] = row
    return torch.tensor(row_map, dtype=torch.long, pin_memory=True).to("cuda", non_blocking=True)


def time_waves(streams: DeviceStreams, expert_rows: list, row_map, launch, repeats: int) -> tuple:
    """`repeats` waves as the verify pass enqueues them, each after its copies' ready events (recorded now,
    behind whatever the GPU is doing); ({step: host us per wave}, GPU ms per wave back to back)."""
    ready = [streams.record() for _ in expert_rows]
    spans = {"wait": [], "row_map": [], "launch": []}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        t0 = time.perf_counter()
        streams.wait_all(ready)
        t1 = time.perf_counter()
        row_of_expert = row_map(expert_rows)
        t2 = time.perf_counter()
        launch(row_of_expert)
        t3 = time.perf_counter()
        for key, (a, b) in zip(spans, ((t0, t1), (t1, t2), (t2, t3))):
            spans[key].append((b - a) * 1e6)
    end.record()
    end.synchronize()
    return spans, start.elapsed_time(end) / repeats


def check_wave(hidden, top_k, pool, expert_rows, inter, row_map, launch, rows) -> None:
    """One way's wave rows against the torch reference's (fp16 GEMMs: within 2e-2 relative)."""
    rows.zero_()
    row_of_expert = row_map(expert_rows)
    launch(row_of_expert)
    reference = torch.zeros_like(rows)
    slot_moe_rows_reference(hidden, top_k, pool, row_of_expert, inter, reference)
    scale = reference.abs().max().clamp_min(1e-6)
    if (rows - reference).abs().max() / scale > 2e-2:
        raise AssertionError(f"wave of {len(expert_rows)}: the slot kernel's rows differ from the reference")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["dsv2"])
    parser.add_argument("--tokens", type=int, default=33, help="rows of the verify window (K + 1)")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None, help="write wave_host.csv here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench_wave_host.py needs a CUDA GPU")
    if args.tokens < 1 or args.repeats < 1:
        sys.exit("error: --tokens and --repeats must be at least 1")
    log = RowLog(args.out / "wave_host.csv") if args.out else None
    for name in args.models:
        rows = bench(name, args.tokens, args.repeats)
        print("\n".join(format_row(row) for row in rows), flush=True)
        for row in rows if log is not None else []:  # each model's rows as it finishes
            log.add(row, f"one seeded routed layer, {args.tokens} tokens, repeats={args.repeats}")


if __name__ == "__main__":
    main()
