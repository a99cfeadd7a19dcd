"""Benchmark one MoE layer's routed experts: fused and decode INT4 Triton kernels vs unfused INT4, FP16, torch INT4.

    python benchmarks/bench_kernel.py --out DIR            # CUDA, fp16, the three real shapes, T in {1,4,16,64,128}
    python benchmarks/bench_kernel.py --out DIR --smoke    # CPU dry run of the script through the Triton interpreter

For every case: correctness first (relative error of each system on fresh random inputs against fp32
math: the INT4 systems against fp32 dequantize + matmul, the FP16 system against its fp32 weights),
then the median latency over --reps calls (CUDA events; the GPU is idle before each call, so host
launch overhead and host syncs count). Appends each row to DIR/kernel.csv as it is measured (with the
commit, host and workload) and prints a table and speed ratios.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {  # name: (hidden, intermediate, routed experts, top_k)
    "deepseek-v2-lite": (2048, 1408, 64, 6),
    "qwen1.5-moe": (2048, 1408, 60, 4),
    "phi-3.5-moe": (4096, 6400, 16, 2),
}
SMOKE_SHAPES = {"smoke": (256, 128, 8, 2)}
TOKENS = (1, 4, 16, 64, 128)
SWEEP = [(16, n, st, 4) for n in (32, 64) for st in (2, 3)] + [(32, 64, 2, 4)]  # (block_m, block_n, stages, warps)
DECODE_SWEEP = [(gu, dn, st, wp) for gu, dn in ((16, 32), (32, 64), (64, 128), (32, 32), (16, 64))
                for st in (2, 4) for wp in (2, 4)]  # (gate_up block_n, down block_n, stages, warps)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for kernel.csv (created if missing)")
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep", action="store_true", help="also time the fused kernel with other tile configs "
                   "(on CUDA, each as a graph replay too)")
    p.add_argument("--smoke", action="store_true", help="CPU dry run: tiny shape, fp32, Triton interpreter")
    return p.parse_args()


@dataclass
class Layer:
    """One MoE layer's routed experts: dense weights (FP16 system) and their INT4 quantization."""

    name: str
    hidden: int
    inter: int
    experts: int
    top_k: int
    gate_up_w: torch.Tensor  # [E, 2I, H]
    down_w: torch.Tensor  # [E, H, I]
    gate_up: object  # Int4Linear [E, H/8, 2I]
    down: object  # Int4Linear [E, I/8, H]


def build_layer(name, shape, device, dtype, seed) -> Layer:
    from specter.quant.int4 import quantize_rtn

    hidden, inter, experts, top_k = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    gate_up_w = torch.randn(experts, 2 * inter, hidden, device=device, dtype=dtype, generator=gen) * 0.02
    down_w = torch.randn(experts, hidden, inter, device=device, dtype=dtype, generator=gen) * 0.02
    return Layer(name, hidden, inter, experts, top_k, gate_up_w, down_w, quantize_rtn(gate_up_w), quantize_rtn(down_w))


def make_inputs(layer: Layer, tokens: int, device, dtype, gen: torch.Generator):
    """hidden [T, H], top_k_index [T, k] (random top-k without replacement), routing weights [T, k]."""
    x = torch.randn(tokens, layer.hidden, device=device, generator=gen).to(dtype)
    idx = torch.rand(tokens, layer.experts, device=device, generator=gen).topk(layer.top_k).indices
    w = torch.rand(tokens, layer.top_k, device=device, generator=gen).softmax(-1).to(dtype)
    return x, idx, w


def systems(layer: Layer, kernels, sweep: bool) -> dict:
    """name -> (fn(x, idx, w) -> [T, H], reference kind: 'int4' or 'dense')."""
    from specter.kernels.int4_decode import DecodeConfig, int4_moe_decode
    from specter.kernels.reference import expert_wise_moe, int4_moe_reference

    silu, ws = torch.nn.functional.silu, kernels.MoEWorkspace()
    dense_of = lambda e: (layer.gate_up_w[e], layer.down_w[e])  # noqa: E731
    table = {
        "fused_int4": (lambda x, i, w: kernels.fused_int4_moe(x, i, w, layer.gate_up, layer.down, silu, ws), "int4"),
        "decode_int4": (lambda x, i, w: int4_moe_decode(x, i, w, layer.gate_up, layer.down, silu, ws), "int4"),
        "unfused_int4": (lambda x, i, w: kernels.unfused_int4_moe(x, i, w, layer.gate_up, layer.down, silu, ws),
                         "int4"),
        "fp16_expert_wise": (lambda x, i, w: expert_wise_moe(x, i, w, dense_of, layer.experts, silu), "dense"),
        "torch_int4_reference": (lambda x, i, w: int4_moe_reference(x, i, w, layer.gate_up, layer.down, silu),
                                 "int4"),
    }
    for bm, bn, st, wp in SWEEP if sweep else []:
        cfg = kernels.KernelConfig(block_m=bm, block_n=bn, num_stages=st, num_warps=wp)
        fn = (lambda c, cw: lambda x, i, w: kernels.fused_int4_moe(x, i, w, layer.gate_up, layer.down, silu,
                                                                   cw, c))(cfg, kernels.MoEWorkspace())
        table[f"fused_int4[m{bm}n{bn}s{st}w{wp}]"] = (fn, "int4")
    for gu, dn, st, wp in DECODE_SWEEP if sweep else []:
        cfg = DecodeConfig(gate_up_block_n=gu, down_block_n=dn, num_stages=st, num_warps=wp)
        fn = (lambda c, cw: lambda x, i, w: int4_moe_decode(x, i, w, layer.gate_up, layer.down, silu, cw, c))(
            cfg, kernels.MoEWorkspace())
        table[f"decode_int4[g{gu}d{dn}s{st}w{wp}]"] = (fn, "int4")
    return table


def fp32_references(layer: Layer, x, idx, w) -> dict:
    """fp32 math on the same inputs: INT4 dequantize + matmul, and the dense weights in fp32."""
    from specter.kernels.reference import expert_wise_moe, int4_moe_reference

    silu, x32, w32 = torch.nn.functional.silu, x.float(), w.float()
    gate_up32, down32 = layer.gate_up.to(dtype=torch.float32), layer.down.to(dtype=torch.float32)
    dense32 = lambda e: (layer.gate_up_w[e].float(), layer.down_w[e].float())  # noqa: E731
    return {"int4": int4_moe_reference(x32, idx, w32, gate_up32, down32, silu),
            "dense": expert_wise_moe(x32, idx, w32, dense32, layer.experts, silu)}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def median_ms(fn, warmup: int, reps: int, cuda: bool) -> float:
    """Median latency of fn(); each call starts on an idle device so launch overhead is included."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graph_replay(fn, x, idx, w):
    """fn(x, idx, w) captured once as a CUDA graph (the fused kernel needs no host sync, as in the draft
    step's graph): returns (replay function, its output tensor)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(x, idx, w)  # warm-up: compiles, sizes the workspace
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = fn(x, idx, w)
    torch.cuda.current_stream().wait_stream(stream)
    return graph.replay, out


def graph_row(layer: Layer, tokens: int, name: str, fn, inputs: tuple, args) -> dict:
    """fn timed as a CUDA graph replay (as the draft step runs it: no launch overhead), checked against eager."""
    replay, out = graph_replay(fn, *inputs)
    replay()
    err = rel_err(out, fn(*inputs).float())  # vs eager, same inputs
    ms = median_ms(replay, args.warmup, args.reps, True)
    graph_name = name.replace("_int4", "_int4_graph", 1)
    print(f"{layer.name:18s} T={tokens:<4d} {graph_name:26s} {ms:9.4f} ms  vs eager {err:.2e}", flush=True)
    return {"model": layer.name, "hidden": layer.hidden, "intermediate": layer.inter, "experts": layer.experts,
            "top_k": layer.top_k, "tokens": tokens, "system": graph_name, "median_ms": round(ms, 4),
            "rel_err": f"{err:.2e}"}


def bench_layer(layer: Layer, args, kernels, device, dtype, record=lambda row: row) -> list[dict]:
    """Every system's row at each token count, each passed to `record` as it is measured."""
    rows, gen = [], torch.Generator(device=device).manual_seed(args.seed + 1)
    table = systems(layer, kernels, args.sweep)
    for tokens in args.tokens:
        x, idx, w = make_inputs(layer, tokens, device, dtype, gen)  # fresh inputs for the correctness check
        refs = fp32_references(layer, x, idx, w)
        errs = {name: rel_err(fn(x, idx, w), refs[kind]) for name, (fn, kind) in table.items()}
        x, idx, w = make_inputs(layer, tokens, device, dtype, gen)  # timing inputs
        for name, (fn, _) in table.items():
            ms = median_ms(lambda: fn(x, idx, w), args.warmup, args.reps, device.type == "cuda")
            rows.append(record({"model": layer.name, "hidden": layer.hidden, "intermediate": layer.inter,
                                "experts": layer.experts, "top_k": layer.top_k, "tokens": tokens, "system": name,
                                "median_ms": round(ms, 4), "rel_err": f"{errs[name]:.2e}"}))
            print(f"{layer.name:18s} T={tokens:<4d} {name:26s} {ms:9.4f} ms  rel_err {errs[name]:.2e}", flush=True)
        for name in [n for n in table if n.startswith(("fused_int4", "decode_int4"))] if device.type == "cuda" else []:
            rows.append(record(graph_row(layer, tokens, name, table[name][0], (x, idx, w), args)))
    return rows


def print_ratios(rows: list[dict]) -> None:
    """Speed-ups of the fused kernel per case: unfused/fused, fp16/fused, reference/fused (>1: fused faster)."""
    ms = {(r["model"], r["tokens"], r["system"]): r["median_ms"] for r in rows}
    print(f"\n{'model':18s} {'T':>4s} {'fused ms':>9s} {'unfused/fused':>14s} {'fp16/fused':>11s} {'ref/fused':>10s} "
          f"{'fp16/fused_graph':>15s} {'fused/decode (graph)':>20s}")
    for model, tokens in dict.fromkeys((r["model"], r["tokens"]) for r in rows):
        fused = ms[(model, tokens, "fused_int4")]
        ratio = lambda s: ms[(model, tokens, s)] / fused  # noqa: E731
        graph = ms.get((model, tokens, "fused_int4_graph"))
        graph_text = f"{ms[(model, tokens, 'fp16_expert_wise')] / graph:15.2f}" if graph else f"{'-':>15s}"
        decode = ms.get((model, tokens, "decode_int4_graph"))
        decode_text = f"{graph / decode:20.2f}" if graph and decode else f"{'-':>20s}"
        print(f"{model:18s} {tokens:4d} {fused:9.4f} {ratio('unfused_int4'):14.2f} "
              f"{ratio('fp16_expert_wise'):11.2f} {ratio('torch_int4_reference'):10.2f} {graph_text} {decode_text}")


def main() -> int:
    args = parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated: before importing them
        shapes, device, dtype = SMOKE_SHAPES, torch.device("cpu"), torch.float32
        args.tokens, args.reps, args.warmup = [t for t in args.tokens if t <= 4], 2, 1
    elif not torch.cuda.is_available():
        print("bench_kernel.py needs a CUDA device (none found); use --smoke for a CPU dry run", file=sys.stderr)
        return 2
    else:
        shapes, device, dtype = {m: SHAPES[m] for m in args.models}, torch.device("cuda"), torch.float16
    sys.path.insert(0, str(ROOT))
    from benchmarks.row_log import RowLog
    from specter.kernels import int4_moe as kernels

    if not kernels.TRITON_AVAILABLE:
        print("bench_kernel.py needs triton (pip install triton)", file=sys.stderr)
        return 2
    t0, rows, log = time.perf_counter(), [], RowLog(Path(args.out) / "kernel.csv")
    workload = (f"{str(dtype).removeprefix('torch.')} reps={args.reps} warmup={args.warmup} seed={args.seed}"
                f"{' smoke (Triton interpreter)' if args.smoke else ''}")
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu (interpreter)'}, {dtype}")
    for name, shape in shapes.items():
        layer = build_layer(name, shape, device, dtype, args.seed)
        rows += bench_layer(layer, args, kernels, device, dtype, lambda row: log.add(row, workload))
        del layer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_ratios(rows)
    print(f"\nwrote {log.path} ({len(rows)} rows, {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
