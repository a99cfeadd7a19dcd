"""Cold experts on the host CPU: one expert's gated MLP per dtype, thread count and token count, beside its copy.

For one routed expert of each model (seeded weights in a `HostExpertStore`, pinned when a GPU is present,
as the offload runtime keeps them): the host's time for `expert_mlp` at 1, 4 and 16 tokens in bf16, fp16 and
float32 with 1, 4 and all of torch's threads (median of --repeats after a warm-up), the estimate of
`measure_host_cost` in this thread and as the runtime takes it at start-up (in its worker thread,
`HostExpertRunner`) and, on a GPU, the pinned
host-to-device copy of the same expert. Without a GPU the copy column says why it is missing.

    python scripts/bench_host_experts.py --models dsv2 phi --out DIR
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specter.kernels.reference import expert_mlp  # noqa: E402
from specter.metrics import write_rows_csv  # noqa: E402
from specter.models.registry import get_spec  # noqa: E402
from specter.offload.host_store import HostExpertStore  # noqa: E402
from specter.verify.host_experts import HostExpertRunner, measure_host_cost  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TOKENS = (1, 4, 16)


def one_expert_store(name: str, dtype: torch.dtype, device: torch.device) -> HostExpertStore:
    """A one-layer, one-expert host store of `name`'s routed expert shape (seeded N(0, 0.02) weights)."""
    config = get_spec(name).hf_config
    hidden, inter = config["hidden_size"], config.get("moe_intermediate_size") or config["intermediate_size"]
    store = HostExpertStore(1, 1, hidden, inter, dtype, device)
    gen = torch.Generator().manual_seed(0)
    store.put_layer(0, (0.02 * torch.randn(1, 2 * inter, hidden, generator=gen)).to(dtype),
                    (0.02 * torch.randn(1, hidden, inter, generator=gen)).to(dtype))
    return store


def cpu_ms(store: HostExpertStore, tokens: int, repeats: int) -> float:
    gate_up, down = store.split(store.expert(0, 0))
    x = torch.randn(tokens, store.hidden).to(store.dtype)
    expert_mlp(x, gate_up, down, torch.nn.functional.silu)  # warm-up (kernel selection, packing)
    times = []
    for _ in range(repeats):
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


def bench(name: str, dtype: torch.dtype, thread_counts: list[int], repeats: int) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    store = one_expert_store(name, dtype, device)
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
            for row in bench(name, DTYPES[dtype_name], threads, args.repeats):
                rows.append(row)
                print(" | ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    if args.out:
        write_rows_csv(args.out / "host_experts_bench.csv", rows)


if __name__ == "__main__":
    main()
