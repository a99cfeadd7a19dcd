"""The residual decode kernel's tile sweep: rows per program and warps (for another GPU than the H100 it was tuned on).

For each model's routed expert (seeded N(0, 0.02) weights, RTN drafts, encoded on the GPU) in bf16 and fp16, every
plan of the sweep first rebuilds EXPERTS distinct experts in one grouped launch (`DecodeLauncher.group`, the launch
coded slots and decode groups make) and is checked bit for bit against the weights; then the median of --repeats
CUDA-event timings of that launch (the GPU idle before each). One process, so the rows compare directly; the
default plan's row is marked, and each row's ratio is its time over the default's.

    python benchmarks/bench_decode_tiles.py --models dsv2 qwen phi --out DIR
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.row_log import RowLog  # noqa: E402
from specter.kernels.residual_decode import DecodeLauncher, DecodePlan, expert_operands  # noqa: E402
from specter.metrics import format_row  # noqa: E402
from specter.models.registry import get_spec  # noqa: E402
from specter.quant.int4 import GROUP_SIZE, Int4Linear, quantize_rtn  # noqa: E402
from specter.quant.residual import bits_of  # noqa: E402
from specter.quant.residual_expert import encode_expert, expert_layout  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_kernel", Path(__file__).resolve().parent / "bench_kernel.py")
bench_kernel = sys.modules.setdefault("bench_kernel", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(bench_kernel)  # its median_ms: CUDA-event timing, each call from an idle device

EXPERTS = 8  # experts per grouped launch (coded slots' scratch rows)
SWEEP = [dict(block_rows=r, num_warps=w) for r, w in itertools.product((16, 32), (4, 8))]


def expert_shape(name: str) -> tuple[int, int]:
    """(hidden, intermediate) of `name`'s routed experts."""
    config = get_spec(name).hf_config
    return config["hidden_size"], config.get("moe_intermediate_size") or config["intermediate_size"]


def layer_of(hidden: int, inter: int, dtype: torch.dtype, experts: int, device: str = "cuda") -> tuple:
    """(layout, staging [words], items [n, 4], stacked drafts, flat weights [n, numel]) of `experts` seeded experts
    of that shape on `device`."""
    layout = expert_layout(hidden, inter, GROUP_SIZE)
    gen = torch.Generator(device=device).manual_seed(0)
    blobs, drafts, flats = [], [], []
    for _ in range(experts):
        weights = [(0.02 * torch.randn(shape, generator=gen, device=device)).to(dtype) for shape in layout.shapes]
        parts = [quantize_rtn(w) for w in weights]
        blobs.append(encode_expert(weights, parts))
        drafts.append(parts)
        flats.append(torch.cat([w.flatten() for w in weights]))
    offsets = torch.tensor([0] + [b.numel() for b in blobs]).cumsum(0)
    numel = flats[0].numel()
    items = torch.tensor([[int(offsets[i]), blobs[i].numel(), i, i * numel] for i in range(experts)],
                         dtype=torch.int64, device=device)  # [n, 4]: blob offset, words, expert, output offset
    stacked = [Int4Linear(torch.stack([d[p].qweight for d in drafts]), torch.stack([d[p].scales for d in drafts]),
                          GROUP_SIZE) for p in range(2)]
    return layout, torch.cat(blobs), items, stacked, torch.stack(flats)


def bench(name: str, dtype: torch.dtype, repeats: int) -> list[dict]:
    layout, staging, items, stacked, weights = layer_of(*expert_shape(name), dtype, EXPERTS)
    operands = expert_operands(stacked, dtype)
    pool = torch.empty_like(weights)
    rows, default_ms = [], None
    for knobs in SWEEP:
        launcher = DecodeLauncher(DecodePlan.of(layout, dtype, **knobs))
        pool.zero_()
        launcher.group(operands, staging, pool.view(-1), items)
        exact = torch.equal(bits_of(pool), bits_of(weights))
        ms = bench_kernel.median_ms(lambda: launcher.group(operands, staging, pool.view(-1), items), 3, repeats,
                                    cuda=True) if exact else float("nan")
        default = DecodePlan.of(layout, dtype) == launcher.plan
        default_ms = ms if default else default_ms
        rows.append({"model": name, "dtype": str(dtype).removeprefix("torch."), **knobs, "default": default,
                     "bit_exact": exact, "ms_per_expert": round(ms / EXPERTS, 4),
                     "out_gbps": round(weights[0].numel() * 2 * EXPERTS / ms / 1e6, 1)})
    for row in rows:
        row["over_default"] = round(row["ms_per_expert"] * EXPERTS / default_ms, 3)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["dsv2", "qwen", "phi"])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="write decode_tiles.csv here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench_decode_tiles.py needs a CUDA GPU")
    log = RowLog(args.out / "decode_tiles.csv") if args.out else None
    workload = f"{EXPERTS} seeded experts per grouped launch, repeats={args.repeats}"
    for name in args.models:
        for dtype in args.dtypes:
            rows = bench(name, getattr(torch, dtype), args.repeats)
            for row in sorted(rows, key=lambda r: r["ms_per_expert"]):
                print(format_row(row), flush=True)
                if log is not None:
                    log.add(row, workload)
            if not all(row["bit_exact"] for row in rows):
                sys.exit(f"error: a plan of the sweep does not rebuild {name}'s {dtype} experts bit for bit")


if __name__ == "__main__":
    main()
