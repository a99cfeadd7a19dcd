"""Residual transfer on the GPU: is the rebuilt expert bit-exact, and is copy + decode faster than the raw copy?

For one routed expert of each model (gate, up, down; seeded weights, RTN draft codes), in bf16 and fp16:
the pinned host-to-device copy of the raw 16-bit expert, the copy of its residual stream, and the Triton
decode (`specter.kernels.residual_decode.decode_rows`) into device memory, each timed with CUDA events
(median of --repeats, after 2 warm-up calls). Correctness first: every decode is compared bit for bit with the original.

    python scripts/bench_residual.py --models dsv2 qwen --out DIR
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specter.kernels.residual_decode import decode_rows, stream_as_int32  # noqa: E402
from specter.models.registry import get_spec  # noqa: E402
from specter.quant.int4 import GROUP_SIZE, pack_codes, quantize_to_codes, symmetric_scales  # noqa: E402
from specter.quant.residual import bits_of, encode  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_kernel", Path(__file__).resolve().parent / "bench_kernel.py")
bench_kernel = sys.modules.setdefault("bench_kernel", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(bench_kernel)  # its median_ms: CUDA-event timing, each call from an idle device


def expert_linears(name: str, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """Seeded gate, up and down weights [out, in] of one routed expert of `name`."""
    config = get_spec(name).hf_config
    hidden, inter = config["hidden_size"], config.get("moe_intermediate_size") or config["intermediate_size"]
    gen = torch.Generator().manual_seed(seed)
    return [(0.02 * torch.randn(shape, generator=gen)).to(dtype) for shape in ((inter, hidden), (inter, hidden),
                                                                                (hidden, inter))]


def bench(name: str, dtype: torch.dtype, repeats: int) -> dict:
    parts = []
    for weight in expert_linears(name, dtype):
        scales32 = symmetric_scales(weight)
        codes = quantize_to_codes(weight, scales32)
        scales = scales32.to(dtype)
        encoded = encode(weight, codes, scales, GROUP_SIZE)
        encoded = dataclasses.replace(encoded, margin_class=encoded.margin_class.cuda(),
                                      word_start=encoded.word_start.cuda())  # resident with the draft
        parts.append((weight, pack_codes(codes).cuda(), scales.cuda(), encoded,
                      stream_as_int32(encoded.words).pin_memory()))
    raw_host = torch.cat([w.flatten() for w, *_ in parts]).pin_memory()
    raw_device = torch.empty_like(raw_host, device="cuda")
    words_device = [torch.empty_like(words, device="cuda") for *_, words in parts]
    for (weight, qweight, scales, encoded, words), device_words in zip(parts, words_device):
        device_words.copy_(words)
        rebuilt = decode_rows(encoded, qweight, scales, device_words)
        if not torch.equal(bits_of(rebuilt.cpu()), bits_of(weight)):
            raise AssertionError(f"{name} {tuple(weight.shape)} {dtype}: the decoded weights differ")

    def copy_raw():
        raw_device.copy_(raw_host, non_blocking=True)

    def copy_residual():
        for device_words, (*_, words) in zip(words_device, parts):
            device_words.copy_(words, non_blocking=True)

    def decode_all():
        for (_, qweight, scales, encoded, _), device_words in zip(parts, words_device):
            decode_rows(encoded, qweight, scales, device_words)

    raw_ms, residual_ms, decode_ms = (bench_kernel.median_ms(f, 2, repeats, cuda=True)
                                      for f in (copy_raw, copy_residual, decode_all))
    raw_bytes = raw_host.numel() * 2
    sent = sum(encoded.nbytes() for *_, encoded, _ in parts)
    return {"model": name, "dtype": str(dtype).removeprefix("torch."), "raw_mb": round(raw_bytes / 1e6, 3),
            "sent_mb": round(sent / 1e6, 3), "raw_copy_ms": round(raw_ms, 4), "residual_copy_ms": round(residual_ms, 4),
            "decode_ms": round(decode_ms, 4), "decode_gbps": round(raw_bytes / decode_ms / 1e6, 1),
            "copy_plus_decode_over_raw": round((residual_ms + decode_ms) / raw_ms, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["dsv2", "phi"])  # qwen: dsv2's expert shape
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="write residual_bench.csv here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench_residual.py needs a CUDA GPU")
    rows = []
    for name in args.models:
        for dtype in (torch.bfloat16, torch.float16):
            rows.append(bench(name, dtype, args.repeats))
            print(" | ".join(f"{k} {v}" for k, v in rows[-1].items()), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "residual_bench.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
