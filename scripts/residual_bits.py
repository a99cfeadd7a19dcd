"""Bits per weight that residual transfer sends, per model's expert shape, dtype, weight law and draft codes.

Byte counts are deterministic (no timing): the CPU measures them as well as a GPU would. Each row encodes
one expert (gate, up and down projections) of seeded weights and checks that decoding rebuilds it bit
for bit. It also measures what an entropy code could save: the empirical entropy of the residuals in each
(margin class, width) bucket, the bits an ideal static code per bucket would spend on the stream (its tables
not counted: a lower bound), against the fixed-width stream, overall, per margin class, and split between the
weights whose code is the zero point (an interval over every binade below half a scale) and the others; and what
a kernel-friendly code spends: a Huffman code per bucket on each residual's top bits, the rest sent as they are,
its tables counted (4 bits a code length).

    python scripts/residual_bits.py --models dsv2 qwen --out results/reference/residual-bits
"""
from __future__ import annotations

import argparse
import heapq
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specter.metrics import write_rows_csv  # noqa: E402
from specter.models.registry import get_spec  # noqa: E402
from specter.quant.gptq import gptq_quantize  # noqa: E402
from specter.quant.int4 import (GROUP_SIZE, ZERO_POINT, quantize_to_codes, symmetric_scales,  # noqa: E402
                                unpack_codes)
from specter.quant.residual import (MARGINS, RAW_BITS, ResidualTensor, bits_of, class_margins,  # noqa: E402
                                    decode, encode, fold_residuals, intervals, order_keys)

STD = 0.02  # weight scale of the seeded draws (the law's spread; the ratio does not depend on it much)
HUFFMAN_TOP_BITS = (4, 6, 8)  # top bits of a residual that the practical code Huffman-codes per bucket
TABLE_BITS = 4  # bits a code length takes in a bucket's table


def expert_shapes(name: str) -> list[tuple[int, int]]:
    """(out, in) of one routed expert's gate, up and down projections."""
    config = get_spec(name).hf_config
    hidden = config["hidden_size"]
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    return [(inter, hidden), (inter, hidden), (hidden, inter)]


def draw(shape: tuple[int, int], law: str, generator: torch.Generator) -> torch.Tensor:
    if law == "normal":
        return STD * torch.randn(shape, generator=generator)
    uniform = torch.rand(shape, generator=generator) - 0.5  # Laplace by inversion, the same spread
    return -STD / 2**0.5 * torch.sign(uniform) * torch.log1p(-2 * uniform.abs())


def codes_and_scales(weight: torch.Tensor, draft: str, generator: torch.Generator):
    """INT4 codes [out, in] and stored scales [out, in/g] of the draft (RTN, or GPTQ with a seeded Hessian)."""
    if draft == "rtn":
        scales = symmetric_scales(weight)
        return quantize_to_codes(weight, scales), scales.to(weight.dtype)
    inputs = torch.randn(256, weight.shape[1], generator=generator)
    packed = gptq_quantize(weight, inputs.T @ inputs)
    return unpack_codes(packed.qweight), packed.scales.transpose(-1, -2)


def stream_bits(weight: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                encoded: ResidualTensor) -> torch.Tensor:
    """Per margin class (and raw, last): [fixed-width stream bits, ideal entropy-coded bits, weights], float64.

    The entropy of a bucket (class, width) is that of its residual values' frequencies in this tensor."""
    keep, cls, value, width = coded_residuals(weight, codes, scales, encoded)
    out = torch.zeros(len(MARGINS) + 1, 3, dtype=torch.float64)
    raw = (~keep).sum().item()
    out[-1] = torch.tensor([RAW_BITS * raw, RAW_BITS * raw, raw])
    bucket = cls * 32 + width
    symbols, counts = torch.unique((bucket << 20) + value, return_counts=True)  # [distinct (bucket, value)]
    of_symbol = symbols >> 20
    totals = torch.zeros(int(bucket.max()) + 1 if len(bucket) else 1, dtype=torch.float64)
    totals.index_add_(0, of_symbol, counts.double())
    info = counts.double() * torch.log2(totals[of_symbol] / counts.double())  # n_v * log2(n_b / n_v)
    for index in range(len(MARGINS)):
        mine, symbol_mine = cls == index, (of_symbol // 32) == index
        out[index] = torch.tensor([width[mine].sum().item(), info[symbol_mine].sum().item(), mine.sum().item()])
    return out


def huffman_lengths(counts: list[int]) -> dict[int, int]:
    """Code length of each symbol with a non-zero count in an optimal prefix code (Huffman)."""
    heap = [(count, symbol, [symbol]) for symbol, count in enumerate(counts) if count]
    lengths = {symbol: 0 for _, symbol, _ in heap}
    if len(heap) == 1:
        return {heap[0][1]: 1}
    heapq.heapify(heap)
    while len(heap) > 1:
        (count_a, tie, a), (count_b, _, b) = heapq.heappop(heap), heapq.heappop(heap)
        for symbol in a + b:
            lengths[symbol] += 1
        heapq.heappush(heap, (count_a + count_b, tie, a + b))
    return lengths


def practical_saving_bits(weight: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                          encoded: ResidualTensor) -> list[float]:
    """Stream bits the top-bits Huffman code saves on the non-raw weights, one per HUFFMAN_TOP_BITS."""
    _, cls, value, width = coded_residuals(weight, codes, scales, encoded)
    bucket = cls * 32 + width
    fixed = width.sum().item()
    return [fixed - top_bits_code_bits(value, width, bucket, top) for top in HUFFMAN_TOP_BITS]


def top_bits_code_bits(value: torch.Tensor, width: torch.Tensor, bucket: torch.Tensor, top: int) -> float:
    """Bits of a code that Huffman-codes each residual's `top` high bits per bucket (tables counted) and sends
    its other bits as they are."""
    bits = 0.0
    for key in torch.unique(bucket).tolist():
        mine = bucket == key
        wide = int(width[mine][0])
        high = min(top, wide)
        counts = torch.bincount(value[mine] >> (wide - high), minlength=2**high).tolist()
        lengths = huffman_lengths(counts)
        bits += sum(counts[s] * n for s, n in lengths.items()) + mine.sum().item() * (wide - high)
        bits += 2**high * TABLE_BITS
    return bits


def coded_residuals(weight: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    encoded: ResidualTensor) -> tuple[torch.Tensor, ...]:
    """(keep [weights]: the weights of groups not sent raw; then for those, flat int64: margin class, residual in
    the encoded interval, width)."""
    cls = encoded.margin_class.repeat_interleave(encoded.group_size, dim=-1).flatten().long()  # [weights]
    keep = cls < len(MARGINS)
    low, width, fold = intervals(codes, scales, weight.dtype, encoded.group_size,
                                 class_margins(encoded.margin_class), encoded.zero_width)
    value = fold_residuals(order_keys(bits_of(weight)), low, width, fold)[0]
    return keep, cls[keep], value.flatten().long()[keep], width.flatten().long()[keep]


def zero_code_split(weight: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    encoded: ResidualTensor) -> torch.Tensor:
    """[[weights, fixed-width bits, ideal bits]] for the non-raw weights whose code is the zero point (their
    interval spans every binade below s/2) and for the others: where an entropy code's saving comes from."""
    keep, cls, value, width = coded_residuals(weight, codes, scales, encoded)
    zero = codes.flatten()[keep] == ZERO_POINT
    out = torch.zeros(2, 3, dtype=torch.float64)
    for row, mine in enumerate((zero, ~zero)):
        bucket = (cls[mine] * 32 + width[mine]) << 20
        ideal = _information(bucket + value[mine]) - _information(bucket)  # H(value | bucket), in bits
        out[row] = torch.tensor([mine.sum().item(), width[mine].sum().item(), ideal])
    return out


def _information(symbols: torch.Tensor) -> float:
    """Sum over the symbols of -log2 of their empirical frequency (n times the empirical entropy)."""
    _, counts = torch.unique(symbols, return_counts=True)
    counts = counts.double()
    return (counts * torch.log2(counts.sum() / counts)).sum().item()


def measure(name: str, dtype: torch.dtype, law: str, draft: str, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    sent, weights, classes = 0, 0, torch.zeros(len(MARGINS) + 1, dtype=torch.int64)
    bits, split = torch.zeros(len(MARGINS) + 1, 3, dtype=torch.float64), torch.zeros(2, 3, dtype=torch.float64)
    practical = torch.zeros(len(HUFFMAN_TOP_BITS), dtype=torch.float64)
    for shape in expert_shapes(name):
        weight = draw(shape, law, generator).to(dtype)
        codes, scales = codes_and_scales(weight, draft, generator)
        encoded = encode(weight, codes, scales, GROUP_SIZE)
        rebuilt = decode(encoded, codes, scales)
        if not torch.equal(rebuilt.view(torch.int16), weight.view(torch.int16)):
            raise AssertionError(f"{name} {shape}: the rebuilt weights differ")
        sent += encoded.nbytes()
        weights += weight.numel()
        bits += stream_bits(weight, codes, scales, encoded)
        split += zero_code_split(weight, codes, scales, encoded)
        practical += torch.tensor(practical_saving_bits(weight, codes, scales, encoded), dtype=torch.float64)
        classes += torch.bincount(encoded.margin_class.flatten().long(), minlength=len(MARGINS) + 1)
    share = (classes.float() / classes.sum()).tolist()
    fixed, ideal = bits[:, 0].sum().item(), bits[:, 1].sum().item()
    per_class = lambda column: " ".join(f"{b[column] / b[2]:.2f}" if b[2] else "-" for b in bits.tolist())  # noqa: E731
    return {"model": name, "dtype": str(dtype).removeprefix("torch."), "law": law, "draft": draft,
            "bits_per_weight": round(sent * 8 / weights, 3), "expert_mb": round(weights * 2 / 1e6, 3),
            "sent_mb": round(sent / 1e6, 3), "sent_over_raw": round(sent / (weights * 2), 4),
            "margin_class_shares": " ".join(f"{s:.3f}" for s in share),
            "stream_bits_per_weight": round(fixed / weights, 3),
            "entropy_bits_per_weight": round(ideal / weights, 3),
            "entropy_saving_of_sent": round((fixed - ideal) / (sent * 8), 4),
            **{f"huffman_top{top}_saving_of_sent": round(saved.item() / (sent * 8), 4)
               for top, saved in zip(HUFFMAN_TOP_BITS, practical)},
            "class_stream_bits": per_class(0), "class_entropy_bits": per_class(1),
            "zero_code_share": round(split[0, 0].item() / weights, 4),
            "zero_code_bits": f"{split[0, 1] / split[0, 0]:.2f} {split[0, 2] / split[0, 0]:.2f}",
            "zero_code_saving_bits_per_weight": round((split[0, 1] - split[0, 2]).item() / weights, 3),
            "other_saving_bits_per_weight": round((split[1, 1] - split[1, 2]).item() / weights, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["dsv2", "qwen", "phi", "mixtral"])
    parser.add_argument("--drafts", nargs="+", default=["rtn", "gptq"], choices=["rtn", "gptq"])
    parser.add_argument("--out", type=Path, default=None, help="write residual_bits.csv here")
    args = parser.parse_args()
    rows = []
    for name in args.models:
        for dtype in (torch.bfloat16, torch.float16):
            for law in ("normal", "laplace"):
                for draft in args.drafts:
                    rows.append(measure(name, dtype, law, draft))
                    print(" | ".join(str(v) for v in rows[-1].values()), flush=True)
    if args.out:
        write_rows_csv(args.out / "residual_bits.csv", rows)


if __name__ == "__main__":
    main()
