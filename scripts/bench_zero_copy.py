"""Zero-copy reads of pinned host memory on the GPU: can a kernel read expert bytes over PCIe as fast as a copy?

A kernel can read page-locked host memory directly (unified addressing maps it into the device's address
space): one launch then moves (and, for residual transfer, decodes) many experts, instead of a copy and
a decode per expert issued by the host. This script measures, on one GPU:

1. a plain Triton copy kernel from pinned host memory (torch's pinned allocator, and memory registered in
   place as the host stores' is) into device memory, by grid size, against `copy_` (cudaMemcpyAsync);
2. the residual decode kernel reading the blobs straight from host memory (`decode_experts` with the
   staging buffer on the host), GROUP experts per launch, against copying the blobs and decoding them
   from device memory; every decoded expert is compared bit for bit with the original weights.

    python scripts/bench_zero_copy.py --models dsv2 --out DIR
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specter.kernels.residual_decode import decode_experts  # noqa: E402
from specter.metrics import format_row, write_rows_csv  # noqa: E402
from specter.offload.cudart import register_in_place  # noqa: E402
from specter.quant.int4 import Int4Linear  # noqa: E402
from specter.quant.residual import bits_of  # noqa: E402
from specter.quant.residual_expert import encode_expert  # noqa: E402

_here = Path(__file__).resolve().parent
for _name in ("bench_kernel", "bench_residual"):
    _spec = importlib.util.spec_from_file_location(_name, _here / f"{_name}.py")
    sys.modules.setdefault(_name, importlib.util.module_from_spec(_spec))
    _spec.loader.exec_module(sys.modules[_name])
median_ms, expert_parts = sys.modules["bench_kernel"].median_ms, sys.modules["bench_residual"].expert_parts

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

GROUP = 8  # experts per decode launch (a verify wave's loads at 16 slots)
COPY_MB = 128


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """dst[i] = src[i] for i < n, each program every num_programs-th block (src may be mapped host memory)."""
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def copy_rows(repeats: int) -> list[dict]:
    n = COPY_MB * 2**20 // 4
    device = torch.empty(n, dtype=torch.int32, device="cuda")
    pinned = torch.randint(0, 2**30, (n,), dtype=torch.int32).pin_memory()
    registered = torch.randint(0, 2**30, (n,), dtype=torch.int32)
    if not register_in_place(registered):
        raise RuntimeError("cudaHostRegister failed")
    rows = []
    for label, host in (("pin_memory", pinned), ("registered", registered)):
        ms = median_ms(lambda h=host: device.copy_(h, non_blocking=True), 2, repeats, cuda=True)
        rows.append({"source": label, "path": "copy_", "programs": 0, "block": 0, "ms": round(ms, 3),
                     "gbps": round(n * 4 / ms / 1e6, 1), "exact": True})
        for programs in (16, 32, 66, 132, 264, 528):
            for block in (1024, 4096):
                device.zero_()
                try:
                    _copy_kernel[(programs,)](host, device, n, BLOCK=block, num_warps=4)
                    torch.cuda.synchronize()
                except Exception as err:  # a launcher that refuses host pointers: say so, go on
                    rows.append({"source": label, "path": "kernel", "programs": programs, "block": block,
                                 "ms": float("nan"), "gbps": float("nan"), "exact": f"failed: {err}"[:120]})
                    continue
                exact = torch.equal(device.cpu(), host)
                ms = median_ms(lambda h=host, p=programs, b=block: _copy_kernel[(p,)](h, device, n, BLOCK=b,
                                                                                         num_warps=4),
                               2, repeats, cuda=True)
                rows.append({"source": label, "path": "kernel", "programs": programs, "block": block,
                             "ms": round(ms, 3), "gbps": round(n * 4 / ms / 1e6, 1), "exact": exact})
    return rows


def decode_rows(name: str, dtype: torch.dtype, repeats: int) -> list[dict]:
    experts = [expert_parts(name, dtype, seed) for seed in range(GROUP)]
    layout = experts[0][0]
    blobs = [encode_expert([w.view(s) for w, s in zip(weights.split([o * i for o, i in layout.shapes]),
                                                        layout.shapes)], drafts) for _, weights, drafts in experts]
    width = max(b.numel() for b in blobs)
    staging_host = torch.zeros(GROUP, width, dtype=torch.int32).pin_memory()  # [GROUP, width] blobs
    for row, blob in enumerate(blobs):
        staging_host[row, :blob.numel()] = blob
    staging_device = torch.empty_like(staging_host, device="cuda")
    layer_drafts = [Int4Linear(torch.stack([d[i].qweight for _, _, d in experts]).cuda(),
                               torch.stack([d[i].scales for _, _, d in experts]).cuda(), d0.group_size)
                    for i, d0 in enumerate(experts[0][2])]
    raw = experts[0][1].numel()
    pool = torch.empty(GROUP, raw, dtype=dtype, device="cuda")
    items = torch.tensor([[row * width, blobs[row].numel(), row, row * raw] for row in range(GROUP)],
                         dtype=torch.int64, device="cuda")
    raw_host = torch.stack([weights for _, weights, _ in experts]).pin_memory()  # [GROUP, raw]
    rows = []

    def check(label: str) -> bool:
        return torch.equal(bits_of(pool.cpu()), bits_of(raw_host))

    def copy_then_decode(programs):
        staging_device.copy_(staging_host, non_blocking=True)
        decode_experts(staging_device, pool, items, layout, layer_drafts, programs)

    paths = {"raw_copy": lambda programs: pool.copy_(raw_host, non_blocking=True),
             "copy_then_decode": copy_then_decode,
             "decode_from_device": lambda programs: decode_experts(staging_device, pool, items, layout, layer_drafts,
                                                                   programs),
             "zero_copy_decode": lambda programs: decode_experts(staging_host, pool, items, layout, layer_drafts,
                                                                 programs)}
    sent = sum(b.numel() * 4 for b in blobs)
    for path, run in paths.items():
        for programs in ((0,) if path == "raw_copy" else (0, 132, 264, 528)):
            pool.zero_()
            try:
                run(programs)
                torch.cuda.synchronize()
            except Exception as err:
                rows.append({"model": name, "dtype": str(dtype)[6:], "path": path, "programs": programs,
                             "ms_per_expert": float("nan"), "exact": f"failed: {err}"[:120]})
                continue
            exact = check(path)
            ms = median_ms(lambda r=run, p=programs: r(p), 2, repeats, cuda=True) / GROUP
            moved = raw_host[0].numel() * 2 if path == "raw_copy" else sent / GROUP
            rows.append({"model": name, "dtype": str(dtype)[6:], "path": path, "programs": programs,
                         "ms_per_expert": round(ms, 4), "pcie_mb_per_expert": round(moved / 1e6, 2),
                         "effective_gbps": round(moved / ms / 1e6, 1), "exact": exact})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["dsv2"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench_zero_copy.py needs a CUDA GPU")
    rows = copy_rows(args.repeats)
    for row in rows:
        print(format_row(row), flush=True)
    decoded = []
    for name in args.models:
        for dtype in (torch.float16, torch.bfloat16):
            for row in decode_rows(name, dtype, args.repeats):
                print(format_row(row), flush=True)
                decoded.append(row)
    if args.out:
        write_rows_csv(args.out / "zero_copy_bench.csv", rows)
        write_rows_csv(args.out / "zero_copy_decode.csv", decoded)


if __name__ == "__main__":
    main()
