"""PCIe bytes per committed token of Specter's expert-cache policies and MO-SM's, on CPU (no timing: copies counted).

    python benchmarks/sim_offload_bytes.py --moe-layers 4 --k 8 --slots 16 --new-tokens 64 \
        --variants paper eviction=popularity

It builds `--model` (dsv2: DeepSeek-V2-Lite, 64 routed experts top-6; qwen: Qwen1.5-MoE, 60 top-4) at full
width with only `--moe-layers` MoE layers on the CPU: `--weights synthetic` (random, a 4096-token
vocabulary, bf16 by default) or `calibrated` (the real checkpoint's routing locality and acceptance,
specter/models/calibrated.py; bf16 as on the GPU, the full vocabulary). It decodes the built-in prompts with Specter
and with each `--variants` entry (SpecterConfig options over the defaults, `paper` for the paper's design; a
variant may set k). The planner's cost model is
frozen at the H200's draft step time per MoE layer (scaled to the layers built) and its copy bandwidth
(the constants below), so its batch sizes and boundaries are the GPU's.
Per configuration it prints decoding's PCIe megabytes per committed token (specter.metrics.h2d_split's
definition), expert loads per token against the window misses (experts the target routed to that were not
resident when their window started; with residual transfer a load is a blob), their ratio, wasted loads, prefetches, loads ahead, reloads by cause, the hit
rate and the mean accepted length; `--mo-sm` first prints MO-SM's bytes at the same memory.
`--residual-slots` adds the residual what-if: the first BLOB_SAMPLE experts of each layer are encoded against
their INT4 draft (exact blob sizes; their mean prices a load), then Specter's loads with 16-bit slots are priced at a blob each (residual transfer,
the default on a GPU: the same loads, fewer bytes), and residual-coded slots (the same memory holding
slots * expert_bytes // blob_bytes experts as blobs, each rebuilt before its GEMM) are simulated as that
many slots whose loads move a blob; the CPU does not decode (a reference decode takes about a second per
expert), so cache behaviour is the 16-bit loads' and only the load size changes. Every Specter row runs with
`residual_transfer=False` (its loads are counted at 16 bits; the what-if prices them as blobs). `--out DIR` writes every
row to DIR/sim_offload_bytes.csv as it is measured (commit, host, workload). TPOT is not simulated: the copy stream's idle time needs the GPU (benchmarks/bench_offload.py). Reference results:
results/reference/NOTES.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import specter  # noqa: E402
from baselines.mixtral_offloading import MixtralOffloading, same_memory_slots  # noqa: E402
from benchmarks.bench_offload import PROMPTS, parse_variant  # noqa: E402
from benchmarks.row_log import RowLog  # noqa: E402
from specter.models.calibrated import moe_layer_count  # noqa: E402
from specter.models.hybrid import hybridize  # noqa: E402
from specter.models.loading import build_synthetic, hf_config  # noqa: E402
from specter.models.registry import get_spec  # noqa: E402
from specter.models.tokenizer import ByteTokenizer  # noqa: E402
from specter.device.budget import plan_memory  # noqa: E402
from specter.offload.cache_counters import CAUSES  # noqa: E402
from specter.quant.int4 import Int4Linear  # noqa: E402
from specter.quant.residual_expert import encode_experts  # noqa: E402
from specter.offload.runtime import offload_experts  # noqa: E402
from specter.prefetch.planner import CostModel  # noqa: E402

# replayed draft step per MoE layer on the H200 (dsv2: results/reference/NOTES.md; qwen: calibrated-h200/offload-*.csv)
H200_DRAFT_MS_PER_MOE_LAYER = {"dsv2": 6.44 / 26, "qwen": 5.82 / 24}
H200_BYTES_PER_MS = 54.2e6
BLOB_SAMPLE = 4  # experts per MoE layer encoded for the mean blob size
SIM_VOCAB = 4096  # the byte-level prompts need 257 ids; 102400 would only make embeddings and lm_head bigger


def build(name: str, weights: str, moe_layers: int, dtype: torch.dtype, seed: int = 0) -> specter.HybridMoEModel:
    """`name` at full width with `moe_layers` MoE layers (plus its dense layers) on the CPU."""
    base = get_spec(name)
    layers = moe_layers + int(base.hf_config.get("first_k_dense_replace", 0) or 0)
    if weights == "calibrated":  # the calibrated layout needs the real vocabulary
        return specter.load_model(name, weights="calibrated", num_layers=layers, device="cpu", dtype=dtype, seed=seed)
    config = {**base.hf_config, "num_hidden_layers": layers, "vocab_size": SIM_VOCAB,
              "bos_token_id": SIM_VOCAB - 2, "eos_token_id": SIM_VOCAB - 1}
    spec = dataclasses.replace(base, hf_config=config)
    tokenizer = ByteTokenizer(spec.hf_config["vocab_size"])
    return hybridize(build_synthetic(spec, torch.device("cpu"), dtype, seed), spec, tokenizer)


def measure(model, config: specter.SpecterConfig, prompts: list[torch.Tensor], new_tokens: int) -> dict:
    engine = specter.SpecterEngine(model, config)
    if hasattr(engine.planner, "cost"):
        per_layer = H200_DRAFT_MS_PER_MOE_LAYER.get(model.spec.name, H200_DRAFT_MS_PER_MOE_LAYER["dsv2"])  # tiny: dsv2's
        draft_ms = per_layer * model.num_moe_layers
        engine.planner.cost = CostModel(draft_ms_per_token=draft_ms, h2d_bytes_per_ms=H200_BYTES_PER_MS,
                                        frozen=True)
    runs = [engine.generate(ids, new_tokens).stats for ids in prompts]
    total = lambda key: sum(r[key] for r in runs)  # noqa: E731
    expert, tokens = runs[0]["expert_load_bytes"], decode_tokens(runs)  # bytes of one load
    per_token = lambda key: total(key) / tokens  # noqa: E731
    return {
        "pcie_mb_per_token": total("decode_h2d_bytes") / tokens / 1e6,
        "decode_loads_per_token": total("decode_h2d_bytes") / expert / tokens,
        "window_miss_loads_per_token": total("window_miss_bytes") / expert / tokens,
        "bytes_over_window_misses": total("decode_h2d_bytes") / total("window_miss_bytes"),
        "wasted_per_token": per_token("wasted_loads"), "prefetch_per_token": per_token("prefetch_loads"),
        "ahead_per_token": per_token("loads_ahead"),
        **{f"reload_{cause}_per_token": per_token(f"reloads_after_{cause}") for cause in CAUSES},
        "hit_rate": total("hits") / (total("hits") + total("misses")),
        "mean_accepted": sum(r["mean_accepted_length"] for r in runs) / len(runs),
    }


def measure_mo_sm(model, slots: int, prompts: list[torch.Tensor], new_tokens: int) -> dict:
    """MO-SM (Specter's memory, its draft's bytes spent on FP slots): PCIe bytes per decoded token."""
    plan = plan_memory(model.spec, model.hf.config, model.dtype)
    system = MixtralOffloading(model, same_memory_slots(slots, plan))
    runs = [system.generate(ids, new_tokens).stats for ids in prompts]
    return {"pcie_mb_per_token": sum(r["decode_h2d_bytes"] for r in runs) / decode_tokens(runs) / 1e6,
            "slots": system.slots}


def sample_blob_bytes(model, per_layer: int) -> float:
    """Mean bytes of a residual blob over the first `per_layer` experts of every MoE layer, each encoded against
    its layer's INT4 draft as the residual store encodes them (exact sizes; a CPU encode takes seconds)."""
    sizes = []
    for layer, module in enumerate(model.experts):
        gate_up, down = model.host_store.layer_weights(layer)  # [E, 2I, H], [E, H, I]
        chunk = slice(0, per_layer)
        drafts = [Int4Linear(d.qweight[chunk], d.scales[chunk], d.group_size)
                  for d in (module.draft_gate_up, module.draft_down)]
        sizes += [blob.numel() * 4 for blob in encode_experts([gate_up[chunk], down[chunk]], drafts)]
    return sum(sizes) / len(sizes)


def residual_rows(model, config: specter.SpecterConfig, prompts: list[torch.Tensor], new_tokens: int) -> list[dict]:
    """The residual what-if at `config`'s memory: 16-bit loads, the same loads as blobs, residual-coded slots."""
    blob = sample_blob_bytes(model, BLOB_SAMPLE)
    slots, raw = config.resident_experts_per_layer, model.host_store.expert_bytes
    sixteen = measure(model, dataclasses.replace(config, residual_transfer=False), prompts, new_tokens)
    coded_slots = min(model.num_experts, int(slots * raw // blob))
    coded = measure(model, dataclasses.replace(config, residual_transfer=False, resident_experts_per_layer=coded_slots),
                    prompts, new_tokens)
    priced = lambda row: {**row, "pcie_mb_per_token": row["decode_loads_per_token"] * blob / 1e6}  # noqa: E731
    return [{"system": "specter, 16-bit loads", "slots": slots, "blob_over_raw": blob / raw, **sixteen},
            {"system": "specter, residual loads", "slots": slots, "blob_over_raw": blob / raw, **priced(sixteen)},
            {"system": "residual-coded slots", "slots": coded_slots, "blob_over_raw": blob / raw, **priced(coded)}]


def decode_tokens(runs: list[dict]) -> int:
    """The tokens committed after each request's first (the denominator of decoding's bytes per token)."""
    return sum(r["generated_tokens"] - 1 for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(H200_DRAFT_MS_PER_MOE_LAYER), default="dsv2")
    parser.add_argument("--weights", choices=["synthetic", "calibrated"], default="synthetic")
    parser.add_argument("--moe-layers", type=int, default=4)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="default: bfloat16, the GPU's dtype (half float32's memory: 4 dsv2 MoE layers "
                             "need about 12 GB in float32)")
    parser.add_argument("--variants", nargs="*", default=[],
                        help="SpecterConfig options over the defaults, e.g. pooled_slots=0 or paper,prefetch=false")
    parser.add_argument("--mo-sm", action="store_true", help="also MO-SM's PCIe bytes per token (same memory)")
    parser.add_argument("--residual-slots", action="store_true",
                        help="also the residual what-if: residual loads, and residual-coded slots at the same memory")
    parser.add_argument("--out", type=Path, default=None, help="write the rows to OUT/sim_offload_bytes.csv")
    args = parser.parse_args()
    depth = moe_layer_count(hf_config(get_spec(args.model)))
    if not 1 <= args.moe_layers <= depth:
        sys.exit(f"error: --moe-layers must be in 1..{depth} ({args.model} has {depth} MoE layers)")
    if args.k < 1 or args.slots < 1:
        sys.exit("error: --k and --slots must be at least 1")
    t0 = time.time()
    dtype = args.dtype or "bfloat16"
    model = build(args.model, args.weights, args.moe_layers, getattr(torch, dtype))
    prompts = [torch.tensor([model.tokenizer(p)["input_ids"][:16]]) for p in PROMPTS[:args.prompts]]
    print(f"built in {time.time() - t0:.0f} s; {args.model} ({args.weights}), {args.moe_layers} MoE layers, K={args.k}, {args.slots} slots, "
          f"{args.prompts} prompts x {args.new_tokens} tokens", flush=True)
    offload_experts(model, args.slots)
    log = RowLog(args.out / "sim_offload_bytes.csv") if args.out else None
    workload = (f"{args.model} {args.weights} {dtype} moe_layers={args.moe_layers} K={args.k} slots={args.slots} "
                f"prompts={args.prompts}x{args.new_tokens}")
    emit = lambda row: print_row(log.add(row, workload) if log else row)  # noqa: E731
    if args.mo_sm:
        emit({"system": "mo_sm", **measure_mo_sm(model, args.slots, prompts, args.new_tokens)})
    config = specter.SpecterConfig(k=args.k, resident_experts_per_layer=args.slots, cuda_graph=False,
                                   residual_transfer=False)  # loads counted at 16 bits: no CPU decode
    if args.residual_slots:
        for row in residual_rows(model, config, prompts, args.new_tokens):
            emit(row)
    systems = ([] if args.residual_slots else [("specter", {})]) + [(v, parse_variant(v)) for v in args.variants]
    for label, options in systems:
        t1 = time.time()
        row = measure(model, dataclasses.replace(config, **options), prompts, args.new_tokens)  # a variant may set k
        emit({"system": label, "slots": args.slots, **row, "seconds": round(time.time() - t1)})
    if log:
        print(f"rows in {log.path}")


def print_row(row: dict) -> None:
    """One row as `key value | ...` (numbers to 3 decimals), provenance left out."""
    cells = [f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
             if k not in ("commit", "host", "workload")]
    print(" | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
