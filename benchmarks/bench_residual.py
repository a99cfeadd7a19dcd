"""Residual transfer on the GPU: is the rebuilt expert bit-exact, and is copy + decode faster than the raw copy?

For one routed expert of each model (gate_up, down; seeded weights, RTN draft codes), in bf16 and fp16:
the pinned host-to-device copy of the raw 16-bit expert, the copy of its residual blob, and the Triton
decode (`specter.kernels.residual_decode.decode_expert`, one launch) into device memory, each timed with
CUDA events (median of --repeats, after 2 warm-up calls); and the host's time to issue one load through
the offload runtime's streams, raw and residual (the decode launched through Triton's JIT and through
the cache's `DecodeLauncher`, alone or GROUP loads per launch as a decode group does, its copies issued one
by one or together at its launch as residual transfer does); --host-profile writes where each load path's
host time goes
(cProfile, by own time); a grouped path's rows also split its host time into a load that only joins
its group (`_issue`) and what the group's last load adds by launching the decode (`_flush`).
Correctness first: every decode is compared bit for bit with the original. Each model and dtype's row is
appended to OUT/residual_bench.csv as it is measured (with the commit, host and workload).

    python benchmarks/bench_residual.py --models dsv2 qwen --out DIR
"""
from __future__ import annotations

import argparse
import cProfile
import importlib.util
import pstats
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.row_log import RowLog  # noqa: E402
from specter.kernels.residual_decode import (  # noqa: E402
    DecodeLauncher,
    DecodePlan,
    decode_expert,
    expert_operands,
    group_rows,
    launch_decode,
)
from specter.metrics import format_row  # noqa: E402
from specter.models.registry import get_spec  # noqa: E402
from specter.offload.decode_groups import DecodeGroup  # noqa: E402
from specter.offload.streams import DeviceStreams  # noqa: E402
from specter.quant.int4 import GROUP_SIZE, quantize_rtn  # noqa: E402
from specter.quant.residual import bits_of  # noqa: E402
from specter.quant.residual_expert import encode_expert, expert_layout  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_kernel", Path(__file__).resolve().parent / "bench_kernel.py")
bench_kernel = sys.modules.setdefault("bench_kernel", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(bench_kernel)  # its median_ms: CUDA-event timing, each call from an idle device


def expert_parts(name: str, dtype: torch.dtype, seed: int = 0) -> tuple:
    """(layout, flat weights, RTN drafts) of one seeded routed expert of `name` (gate_up, down)."""
    config = get_spec(name).hf_config
    hidden, inter = config["hidden_size"], config.get("moe_intermediate_size") or config["intermediate_size"]
    layout = expert_layout(hidden, inter, GROUP_SIZE)
    gen = torch.Generator().manual_seed(seed)
    weights = [(0.02 * torch.randn(shape, generator=gen)).to(dtype) for shape in layout.shapes]
    return layout, torch.cat([w.flatten() for w in weights]), [quantize_rtn(w) for w in weights]


def bench(name: str, dtype: torch.dtype, repeats: int, profile: Path | None = None) -> dict:
    layout, weights, drafts = expert_parts(name, dtype)
    blob_host = encode_expert([w.view(shape) for w, shape in zip(weights.split([o * i for o, i in layout.shapes]),
                                                                     layout.shapes)], drafts).pin_memory()
    drafts = [d.to("cuda") for d in drafts]  # resident with the draft model
    raw_host = weights.pin_memory()
    raw_device, blob_device = torch.empty_like(raw_host, device="cuda"), torch.empty_like(blob_host, device="cuda")
    blob_device.copy_(blob_host)
    rebuilt = decode_expert(blob_device, layout, drafts, torch.empty_like(raw_device))
    if not torch.equal(bits_of(rebuilt.cpu()), bits_of(weights)):
        raise AssertionError(f"{name} {dtype}: the decoded weights differ")

    raw_ms, blob_ms, decode_ms = (bench_kernel.median_ms(f, 2, repeats, cuda=True) for f in (
        lambda: raw_device.copy_(raw_host, non_blocking=True),
        lambda: blob_device.copy_(blob_host, non_blocking=True),
        lambda: decode_expert(blob_device, layout, drafts, raw_device)))
    raw_bytes, sent = raw_host.numel() * 2, blob_host.numel() * 4
    host_us = host_cost_us(raw_host, blob_host, layout, drafts, weights.dtype, profile=profile)
    return {"model": name, "dtype": str(dtype).removeprefix("torch."), "raw_mb": round(raw_bytes / 1e6, 3),
            "sent_mb": round(sent / 1e6, 3), "bits_per_weight": round(8 * sent / weights.numel(), 2),
            "raw_copy_ms": round(raw_ms, 4), "residual_copy_ms": round(blob_ms, 4),
            "decode_ms": round(decode_ms, 4), "decode_gbps": round(raw_bytes / decode_ms / 1e6, 1),
            "copy_plus_decode_over_raw": round((blob_ms + decode_ms) / raw_ms, 3),
            "copy_over_raw": round(blob_ms / raw_ms, 3),
            **{f"host_us_per_{path}_load": round(us, 1) for path, us in host_us.items()}}


GROUP = 4  # loads per decode launch of the grouped path
PROFILE_LINES = 25  # functions per path in the --host-profile file
PROFILE_LOADS = 512  # loads per path under cProfile (enough for its millisecond columns to resolve a load)


def load_paths(raw_host: torch.Tensor, blob_host: torch.Tensor, layout, drafts, dtype) -> tuple:
    """(synchronize, rows, {path: (loads per sample, issue(sample))}): one load through the offload runtime's
    streams into device row `sample % 2` (a group: rows of that half): `DeviceStreams.copy` of the raw expert
    (raw), `copy_decoded` of the blob with the decode launched through Triton's JIT (residual_jit), through
    the `DecodeLauncher` the cache uses (residual), and through its grouped launch, GROUP loads per launch
    (residual_group), and with a group's copies issued together at its launch (residual_group_copies, what
    residual transfer runs)."""
    streams, together = (DeviceStreams(torch.device("cuda")) for _ in range(2))
    together.group_copies = True
    rows = torch.empty(2 * GROUP, raw_host.numel(), dtype=dtype, device="cuda")
    plan, operands = DecodePlan.of(layout, dtype), expert_operands(drafts, dtype)
    launcher = DecodeLauncher(plan)
    stacked = tuple(operand.unsqueeze(0) for operand in operands)  # a layer of one expert
    group, together_group = (DecodeGroup(
        "bench", GROUP, lambda staging, items, s=s: launcher.group(
            stacked, staging, rows, s.upload_rows(group_rows(items, rows), 4, ring="decode")))
        for s in (streams, together))
    jit = lambda blob, out: launch_decode(plan, operands, blob, out)  # noqa: E731
    one = {"raw": lambda row: streams.copy(rows[row], raw_host),
           "residual_jit": lambda row: streams.copy_decoded(rows[row], blob_host, jit, blob_host.numel()),
           "residual": lambda row: streams.copy_decoded(rows[row], blob_host, partial(launcher, operands),
                                                        blob_host.numel())}
    issue = {name: (1, load) for name, load in one.items()}
    issue["residual_group"] = (GROUP, grouped_loads(streams, group, rows, blob_host))
    issue["residual_group_copies"] = (GROUP, grouped_loads(together, together_group, rows, blob_host))
    every = (streams, together)
    return lambda: [s.synchronize() for s in every], rows, issue


def grouped_loads(streams: DeviceStreams, group: DecodeGroup, rows: torch.Tensor, blob_host: torch.Tensor):
    """load(sample, timed=None): GROUP grouped residual loads into the rows of half `sample` (the last one
    launches the group's decode), each call's host us appended to `timed` when given."""
    def load(sample: int, timed: list | None = None) -> None:
        for i in range(GROUP):
            start = time.perf_counter()
            streams.copy_decoded(rows[sample * GROUP + i], blob_host, None, blob_host.numel(), group=group, member=0)
            if timed is not None:
                timed.append((time.perf_counter() - start) * 1e6)
    return load


def host_cost_us(raw_host: torch.Tensor, blob_host: torch.Tensor, layout, drafts, dtype, loads: int = 32,
                 profile: Path | None = None) -> dict:
    """Host microseconds to issue one load of each of `load_paths`, median over `loads` loads (a grouped
    sample is a whole group, divided by GROUP); with `profile`, each path's loads again under cProfile, the
    functions by own time into that file (which calls of torch and CUDA the host time goes to)."""
    synchronize, rows, issue = load_paths(raw_host, blob_host, layout, drafts, dtype)
    medians = {}
    for name, (per_sample, load) in issue.items():
        load(0)  # first use (allocations, compilation)
        synchronize()
        times = []
        for i in range(loads // per_sample):
            start = time.perf_counter()
            load(i % 2)
            times.append((time.perf_counter() - start) * 1e6 / per_sample)
        synchronize()
        medians[name] = median(times)
    for name, (per_sample, load) in issue.items():
        if per_sample > 1:  # a group's loads one by one: the last one's call also launches the group's decode
            medians[f"{name}_issue"], medians[f"{name}_flush"] = issue_and_flush_us(load, per_sample, loads)
            synchronize()
    if profile is not None:
        with profile.open("w") as out:
            for name, (per_sample, load) in issue.items():
                profiler = cProfile.Profile()
                profiler.runcall(lambda: [load(i % 2) for i in range(PROFILE_LOADS // per_sample)])
                synchronize()
                out.write(f"== {name}: {PROFILE_LOADS} loads\n")
                pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(PROFILE_LINES)
    for row in rows:  # the last loads went through the grouped launch: every row holds the expert bit for bit
        if not torch.equal(bits_of(row.cpu()), bits_of(raw_host)):
            raise AssertionError("a decode through the DecodeLauncher's grouped launch differs from the raw expert")
    return medians


def issue_and_flush_us(load, group: int, loads: int) -> tuple[float, float]:
    """(host us of a grouped load that only joins its group, host us the group's last load adds by launching
    the decode), medians over `loads // group` groups, timing each `copy_decoded` call of `load`'s group."""
    joins, flushes = [], []
    for i in range(loads // group):
        calls = []
        load(i % 2, timed=calls)
        joins += calls[:-1]
        flushes.append(calls[-1])
    return median(joins), median(flushes) - median(joins)


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["dsv2", "phi"])  # qwen: dsv2's expert shape
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="write residual_bench.csv here")
    parser.add_argument("--host-profile", action="store_true",
                        help="profile each load path's host calls into OUT/residual_host_profile_<model>_<dtype>.txt")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench_residual.py needs a CUDA GPU")
    if args.host_profile and args.out is None:
        sys.exit("error: --host-profile writes into --out: give one")
    log = RowLog(args.out / "residual_bench.csv") if args.out else None
    workload = f"one seeded expert, repeats={args.repeats}, group={GROUP}"
    for name in args.models:
        for dtype in (torch.bfloat16, torch.float16):
            profile = (args.out / f"residual_host_profile_{name}_{str(dtype)[6:]}.txt"
                       if args.host_profile and args.out else None)
            row = bench(name, dtype, args.repeats, profile)
            print(format_row(row), flush=True)
            if log is not None:
                log.add(row, workload)


if __name__ == "__main__":
    main()
