"""Cold experts on the host CPU: one expert's gated MLP per dtype, thread count and token count, beside its copy.

For the routed experts of each model (seeded weights in a `HostExpertStore` of enough experts to pass
the CPU's caches, --cold-mb, pinned when a GPU is present, as the offload runtime keeps them): the host's
time for `expert_mlp` at 1, 4 and 16 tokens in bf16, fp16 and float32 with 1, 4 and all of torch's threads
(median of --repeats after a warm-up), on one expert again and again (cpu_ms: its weights stay in the
CPU's caches) and on another expert each call (cold_cpu_ms: read from memory, as a cold expert's are in a
run); the estimate of `measure_host_cost` in this thread and as the runtime takes it at start-up (in its
worker thread, `HostExpertRunner`); on a GPU, the pinned host-to-device copy of one expert. Without a GPU
the copy column says why it is missing.

    python scripts/bench_host_experts.py --models dsv2 phi --out DIR
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specter.kernels.reference import expert_mlp  # noqa: E402
from specter.metrics import format_row, write_rows_csv  # noqa: E402
from specter.models.registry import get_spec  # noqa: E402
from specter.offload.host_store import HostExpertStore  # noqa: E402
from specter.verify.host_experts import HostExpertRunner, measure_host_cost  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TOKENS = (1, 4, 16)
COLD_MB = 512  # experts per store: enough to pass this many MB (more than a CPU's last-level cache)


def expert_store(name: str, dtype: torch.dtype, device: torch.device, cold_mb: float = COLD_MB) -> HostExpertStore:
    """A one-layer host store of `name`'s routed expert shape (seeded N(0, 0.02) weights), with as many
    experts as pass `cold_mb` MB (at least 2)."""
    config = get_spec(name).hf_config
    hidden, inter = config["hidden_size"], config.get("moe_intermediate_size") or config["intermediate_size"]
    experts = max(2, math.ceil(cold_mb * 2**20 / (3 * hidden * inter * dtype.itemsize)))
    store = HostExpertStore(1, experts, hidden, inter, dtype, device)
    gen = torch.Generator().manual_seed(0)
    store.put_layer(0, (0.02 * torch.randn(experts, 2 * inter, hidden, generator=gen)).to(dtype),
                    (0.02 * torch.randn(experts, hidden, inter, generator=gen)).to(dtype))
    return store


def cpu_ms(store: HostExpertStore, tokens: int, repeats: int, cold: bool = False) -> float:
    """Median ms of `expert_mlp` on expert 0 each time, or (`cold`) on the next expert each time."""
    x = torch.randn(tokens, store.hidden).to(store.dtype)
    expert_mlp(x, *store.split(store.expert(0, 0)), torch.nn.functional.silu)  # warm-up (kernel selection, packing)
    times = []
    for i in range(repeats):
        gate_up, down = store.split(store.expert(0, (1 + i) % store.num_experts if cold else 0))
        start = time.perf_counter()
        expert_mlp(x, gate_up, down, torch.nn.functional.silu)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def copy_ms(store: HostExpertStore, repeats: int) -> float | str:
    if not torch.cuda.is_available():
        return "unavailable: no CUDA device"
    src = store.expert(0, 0)
    dst = torch.empty_like(src, device="cuda")
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return round(statistics.median(times[1:]), 4)


def bench(name: str, dtype: torch.dtype, thread_counts: list[int], repeats: int,
          cold_mb: float = COLD_MB) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    store = expert_store(name, dtype, device, cold_mb)
    copy = copy_ms(store, repeats)
    rows = []
    default_threads = torch.get_num_threads()
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            estimate = measure_host_cost(store, torch.nn.functional.silu)
            runner = HostExpertRunner(store, act=torch.nn.functional.silu)  # as the runtime measures it
            runner.close()
            for tokens in TOKENS:
                rows.append({"model": name, "dtype": str(dtype).removeprefix("torch."), "threads": threads,
                             "tokens": tokens, "cpu_ms": round(cpu_ms(store, tokens, repeats), 4),
                             "cold_cpu_ms": round(cpu_ms(store, tokens, repeats, cold=True), 4),
                             "estimate_ms": round(estimate.cpu_ms(tokens), 4),
                             "worker_estimate_ms": round(runner.cost.cpu_ms(tokens), 4), "copy_ms": copy,
                             "pinned": store.buffers[0].is_pinned()})
    finally:
        torch.set_num_threads(default_threads)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["dsv2"])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bfloat16", "float32"])
    parser.add_argument("--threads", nargs="+", type=int, default=None,
                        help="torch CPU thread counts (default: 1, 4 and torch's default)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cold-mb", type=float, default=COLD_MB,
                        help="the store holds experts enough for this many MB (cold_cpu_ms reads each once)")
    parser.add_argument("--out", type=Path, default=None, help="write host_experts_bench.csv here")
    args = parser.parse_args()
    threads = args.threads or sorted({1, 4, torch.get_num_threads()})
    if min(threads) < 1:
        sys.exit("error: --threads must be at least 1")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads by default; "
          f"copy: {'CUDA ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}", flush=True)
    rows = []
    for name in args.models:
        for dtype_name in args.dtypes:
            for row in bench(name, DTYPES[dtype_name], threads, args.repeats, args.cold_mb):
                rows.append(row)
                print(format_row(row), flush=True)
    if args.out:
        write_rows_csv(args.out / "host_experts_bench.csv", rows)


if __name__ == "__main__":
    main()
