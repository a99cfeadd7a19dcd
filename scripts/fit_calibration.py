"""Fit the calibrated weights' RoutingProfile of each model to the real checkpoint's measurements.

1. Routing factors: the hit-rate curves of the calibrated routers are simulated directly from the layout
   (`simulated_routing`: the routing codes seen through router rows in the routing subspace), and the factor
   weights and run lengths are fitted to the real model's row of routing-locality.tsv (LRU at rho 0.5/1/2/4,
   Belady at rho 1/2).
2. Acceptance gain: a reduced-depth calibrated build decodes the local datasets' prompts; one draft-mode
   forward over each committed sequence gives the draft's component along the acceptance direction, and
   the target's top-1/runner-up gaps give the gain at which the draft would reject the wanted fraction of
   positions.
3. Check: the fitted build's target routing is recorded and its curves are compared with the real row.

Prints the fitted RoutingProfile of each model (paste into specter/models/registry.py) and a table.
With --check-only nothing is fitted: the registry's committed profile is built and measured (curves,
and with --check-dtype acceptance and agreement). With --factors the given factors (weight:run length
pairs, `inf` for a popularity) replace step 1 and are built as they are (no corrections); step 2 fits
their gain.

    python scripts/fit_calibration.py --models tiny-mixtral dsv2 --layers 4
    python scripts/fit_calibration.py --models dsv2 qwen --layers 0 --device cuda --check-only --check-dtype bfloat16
    python scripts/fit_calibration.py --models phi --layers 1 --factors 5.623:1.34 0.49:7.92 4.186:44.33 2.098:inf
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from scipy.optimize import minimize
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from experiments.datasets import prompts_for  # noqa: E402
from experiments.locality import REAL_NAMES, calibration_error, locality_curves, reference_curves  # noqa: E402
from experiments.records import token_agreement  # noqa: E402
from experiments.routing_trace import committed_routing  # noqa: E402
from specter import SpecterConfig, SpecterEngine  # noqa: E402
from specter.models.calibrated import (  # noqa: E402
    TOP1_LOGIT,
    RoutingProfile,
    acceptance_direction,
    moe_layer_count,
    simulated_routing,
)
from specter.models.hybrid import hybridize  # noqa: E402
from specter.models.loading import build_synthetic, hf_config, with_layers  # noqa: E402
from specter.models.registry import get_spec  # noqa: E402
from specter.models.tokenizer import ByteTokenizer  # noqa: E402
from specter.quant.gptq import quantize_experts_gptq  # noqa: E402

FIT_POINTS = (("LRU", 0.5), ("LRU", 1.0), ("LRU", 2.0), ("LRU", 4.0), ("Belady", 1.0), ("Belady", 2.0))
TARGET_ACCEPTANCE = {"dsv2": 0.978, "qwen": 0.965, "phi": 0.965, "mixtral": 0.965}
DATASETS = ("gsm8k", "wikitext2", "humaneval")
FULL_EMBED_SCALE = 12.0  # dsv2's dense first layer alone writes about RMS 1 into the residual stream


def simulated_curves(profile: RoutingProfile, experts: int, top_k: int, hidden: int, sequences: int = 8,
                     tokens: int = 128, seed: int = 0) -> dict:
    """Hit rates of the calibrated routing, simulated from the layout without building a model."""
    generator = torch.Generator().manual_seed(seed)
    d_r = max(8, hidden // 4)
    traces = [simulated_routing(tokens, profile, experts, top_k, d_r, 1, generator)[0] for _ in range(sequences)]
    return locality_curves(traces, top_k, policies=("LRU", "Belady"), rhos=(0.5, 1.0, 2.0, 4.0))


def profile_from(x: np.ndarray) -> RoutingProfile:
    fast, slow, static = np.abs(x[:3])
    return RoutingProfile(factors=((float(fast), 1 + math.exp(x[3])), (float(slow), 1 + math.exp(x[4])),
                                   (float(static), math.inf)), token_weight=1.0, accept_gain=0.0)


def built_like(fitted: RoutingProfile, profile: RoutingProfile) -> RoutingProfile:
    """`fitted`'s factors with `profile`'s build settings (embedding scale, cleared routing, token pick), no gain."""
    return dataclasses.replace(fitted, accept_gain=1.0, embed_scale=profile.embed_scale,
                               clear_routing=profile.clear_routing, token_pick=profile.token_pick)


def fit_factors(target: dict, experts: int, top_k: int, hidden: int, token_pick: float = 0.0,
                sequences: int = 8) -> RoutingProfile:
    """Factor weights and run lengths whose simulated curves match `target` (grid, then Nelder-Mead), with
    `token_pick` held fixed, on `sequences` simulated walks of 128 tokens."""
    def loss(x):
        profile = dataclasses.replace(profile_from(x), token_pick=token_pick)
        return fit_loss(simulated_curves(profile, experts, top_k, hidden, sequences), target)

    wide = 2.0 if token_pick else 1.0  # a pick takes rank 1 often: rank 2's locality needs stronger factors
    fast = (0.3, 0.6, 1.0, 2.0) if token_pick else (0.3, 0.6, 1.0)
    grid = [np.array([f, s, st, math.log(lf - 1), math.log(ls - 1)]) for f in fast
            for s in (0.0, 0.4 * wide, 0.8 * wide) for st in (0.0, 0.3 * wide, 0.6 * wide)
            for lf in (1.5, 3.0, 6.0) for ls in (15.0, 50.0)]
    start = min(grid, key=loss)
    best = minimize(loss, start, method="Nelder-Mead", options={"maxfev": 150, "xatol": 0.01, "fatol": 1e-4})
    return dataclasses.replace(profile_from(best.x), token_pick=token_pick)


def local_prompts(tokenizer, per_dataset: int, prefix: int = 16) -> list[torch.Tensor]:
    prompts = []
    for name in DATASETS:
        cfg = OmegaConf.create({"name": name, "members": [name], "path": None, "source": "local"})
        prompts += [torch.tensor([tokenizer(t)["input_ids"][:prefix]]) for t in prompts_for(cfg, per_dataset)[name]]
    return prompts


@torch.inference_mode()
def greedy_walk(model, prompt: torch.Tensor, tokens: int) -> list[int]:
    """The target's greedy continuation (resident experts, one token at a time)."""
    cache, ids, out = DynamicCache(config=model.hf.config), prompt.to(model.device), []
    for _ in range(tokens):
        nxt = int(model.forward(ids, cache)[0, -1].argmax())
        out.append(nxt)
        ids = torch.tensor([[nxt]], device=model.device)
    return out


@torch.inference_mode()
def rejection_ratios(model, prompt: torch.Tensor, generated: list[int], seed: int) -> np.ndarray:
    """Per committed position: the effective gain above which the draft picks the runner-up (inf: never)."""
    ids = torch.cat([prompt, torch.tensor([generated])], dim=1).to(model.device)
    final = {}
    handle = model.hf.model.norm.register_forward_hook(lambda m, a, out: final.__setitem__("x", out[0]))
    try:
        model.forward(ids, DynamicCache(config=model.hf.config), mode="draft")
    finally:
        handle.remove()
    target = model.forward(ids, DynamicCache(config=model.hf.config))[0].float().cpu()  # [T, V]
    g = acceptance_direction(model.hf.config.hidden_size, seed)
    head = model.hf.get_output_embeddings().weight.float().cpu()
    n = prompt.numel()
    top2 = target[n - 1:-1].topk(2, dim=1)  # positions that predict the generated tokens
    gap = (top2.values[:, 0] - top2.values[:, 1]).numpy()
    sign = torch.sign(head[top2.indices] @ g).numpy()  # [T, 2]: the g sign of top-1 and runner-up rows
    gx = (final["x"][n - 1:-1].float().cpu() @ g).numpy()  # [T]
    push = (sign[:, 1] - sign[:, 0]) * TOP1_LOGIT * gx  # runner-up's gain per unit effective gain
    with np.errstate(divide="ignore"):
        return np.where(push > 0, gap / push, np.inf)


def fit_gain(ratios: np.ndarray, acceptance: float) -> float:
    """The smallest effective gain at which a fraction 1 - acceptance of positions reject."""
    return float(np.quantile(ratios, 1 - acceptance))


def probe_build(spec, layers: int | None, profile: RoutingProfile, per_dataset: int, seed: int, device: str,
                dtype: torch.dtype):
    """(model, prompts, greedy walks, measured curves) of a calibrated build (`layers` deep; None: full)."""
    probe = dataclasses.replace(with_layers(spec, layers), routing_profile=profile)
    config = hf_config(probe)
    model = hybridize(build_synthetic(probe, torch.device(device), dtype, seed, calibrated=True), probe,
                      ByteTokenizer(config.vocab_size))
    prompts = local_prompts(model.tokenizer, per_dataset)
    walks = [greedy_walk(model, p, 128) for p in prompts]
    traces = [layer for p, w in zip(prompts, walks) for layer in committed_routing(model, p, w)]
    curves = locality_curves(traces, config.num_experts_per_tok, policies=("LRU", "Belady"),
                             rhos=(0.5, 1.0, 2.0, 4.0))
    return model, prompts, walks, curves


def lru_by_layer(model, prompts: list[torch.Tensor], walks: list[list[int]], rho: float = 1.0) -> list[float]:
    """LRU hit rate at `rho` x top-k of each MoE layer over the committed walks: where locality thins with
    depth (the curves above average the layers)."""
    top_k = hf_config(model.spec).num_experts_per_tok
    by_layer = list(zip(*(committed_routing(model, p, w) for p, w in zip(prompts, walks))))  # [layer][prompt]
    return [round(locality_curves(list(traces), top_k, policies=("LRU",), rhos=(rho,))[("LRU", rho)], 3)
            for traces in by_layer]


def refine_on_build(spec, layers, profile: RoutingProfile, target: dict, per_dataset: int, seed: int,
                    evaluations: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> RoutingProfile:
    """Nelder-Mead on the built model's own measured curves (a build per evaluation: seconds for small models
    on a CPU, about a minute for phi at its real depth on an H200). One build is alive at a time."""
    def loss(x):
        probe = built_like(profile_from(x), profile)
        curves = probe_build(spec, layers, probe, per_dataset, seed, device, dtype)[3]
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        return fit_loss(curves, target)

    (fast, fast_run), (slow, slow_run), (static, _) = profile.factors
    start = np.array([fast, slow, static, math.log(fast_run - 1), math.log(slow_run - 1)])
    best = minimize(loss, start, method="Nelder-Mead", options={"maxfev": evaluations, "xatol": 0.01})
    return built_like(profile_from(best.x), profile)


@torch.inference_mode()
def decode_check(model, prompts: list[torch.Tensor], walks: list[list[int]]) -> tuple[float, float]:
    """(Specter's mean acceptance at K=8, its mean token agreement with the greedy target's `walks`)."""
    engine = SpecterEngine(model, SpecterConfig(k=8))
    results = [engine.generate(prompt.to(model.device), 128) for prompt in prompts]
    return (round(float(np.mean([r.stats["acceptance_rate"] for r in results])), 4),
            round(float(np.mean([token_agreement(r.token_ids, w) for r, w in zip(results, walks)])), 4))


def check_in(dtype: torch.dtype, spec, profile: RoutingProfile, per_dataset: int, seed: int, device: str,
             gptq: bool = False, layers: int | None = None) -> dict:
    """The fitted build at its real depth (or `layers` deep) in `dtype`: Specter's acceptance and agreement
    with greedy target (RTN draft; with `gptq` also a GPTQ draft calibrated on the walks of the next
    `per_dataset` prompts of each dataset, which the check does not decode)."""
    fitted = dataclasses.replace(with_layers(spec, layers), routing_profile=profile)
    model = hybridize(build_synthetic(fitted, torch.device(device), dtype, seed, calibrated=True), fitted,
                      ByteTokenizer(fitted.hf_config["vocab_size"]))
    span = 2 * per_dataset if gptq else per_dataset
    prompts = local_prompts(model.tokenizer, span)  # per dataset: `span` prompts, the first `per_dataset` checked
    checked = [p for i, p in enumerate(prompts) if i % span < per_dataset]
    walks = [greedy_walk(model, p, 128) for p in checked]
    acceptance, agreement = decode_check(model, checked, walks)
    out = {"dtype": str(dtype).removeprefix("torch."), "acceptance": acceptance, "token_agreement": agreement}
    print(f"  check (RTN draft): {out}", file=sys.stderr, flush=True)
    if gptq:
        calibration = [p for i, p in enumerate(prompts) if i % span >= per_dataset]
        ids = [torch.cat([p, torch.tensor([greedy_walk(model, p, 128)])], dim=1) for p in calibration]  # [1, T]
        quantize_experts_gptq(model, ids, progress=True)
        out["gptq_acceptance"], out["gptq_token_agreement"] = decode_check(model, checked, walks)
    return out


def fit_loss(curves: dict, target: dict) -> float:
    """What the fits minimise: the mean error, plus a penalty on the largest past 0.025."""
    largest, mean = calibration_error(curves, target)
    return mean + 2.0 * max(0.0, largest - 0.025)


def correct_by_builds(spec, layers, profile: RoutingProfile, target: dict, rounds: int, per_dataset: int, seed: int,
                      device: str, dtype: torch.dtype, step: float = 1.0, sim_sequences: int = 8):
    """(profile, probe build) closest to `target` among `profile` and `rounds` corrections of it: each
    refits the simulation (`sim_sequences` walks) to its last curves moved `step` times the last build's
    error (1: the target shifted by the build's offset from the simulation; less damps a build that
    overreacts).
    One build is alive at a time (a full-width build takes most of a small machine's memory): the best is
    built again at the end unless it is the last."""
    config = hf_config(spec)
    best = None  # (loss, round, profile)
    for round_ in range(rounds + 1):
        build = probe_build(spec, layers, profile, per_dataset, seed, device, dtype)
        curves = build[3]
        largest, mean = calibration_error(curves, target)
        print(f"  {spec.name} round {round_}: build max error {largest:.3f}, mean {mean:.3f}", flush=True)
        loss = fit_loss(curves, target)
        if best is None or loss <= best[0]:  # ties: the later build, still alive at the end
            best = (loss, round_, profile)
        if round_ == rounds:
            break
        build = None
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        simulated = simulated_curves(profile, spec.num_experts, config.num_experts_per_tok, config.hidden_size,
                                     sim_sequences)
        corrected = {p: simulated[p] + step * (v - curves[p]) for p, v in target.items()}
        profile = built_like(fit_factors(corrected, spec.num_experts, config.num_experts_per_tok,
                                         config.hidden_size, profile.token_pick, sim_sequences), profile)
    if best[1] != rounds:
        build = None  # freed before the best is built again
        build = probe_build(spec, layers, best[2], per_dataset, seed, device, dtype)
    return best[2], build


def fit_model(name: str, layers: int | None, per_dataset: int, seed: int, embed_scale: float, device: str = "cpu",
              dtype: torch.dtype = torch.float32, direct: int = 0, rounds: int = 1, step: float = 1.0,
              factors: tuple | None = None, clear_routing: bool = False, token_pick: float = 0.0,
              sim_sequences: int = 8) -> dict:
    """Fit factors on the simulation (or start from `factors` as given), correct them `rounds`
    times by the build's measured offset from the simulation (keeping the build closest to the target),
    optionally refine on the build itself (`direct` evaluations), then fit the gain. Every build keeps the
    residual writers out of the routing subspace when `clear_routing` is set, and picks at `token_pick`.
    The simulation averages `sim_sequences` walks of 128 tokens (8: up to 0.02 per point between seeds)."""
    spec = get_spec(name)
    real = REAL_NAMES.get(spec.name, REAL_NAMES["mixtral"])
    target = {p: v for p, v in reference_curves(real).items() if p in FIT_POINTS}
    config = hf_config(spec)
    experts, top_k, hidden = spec.num_experts, config.num_experts_per_tok, config.hidden_size
    if factors is None:
        profile = dataclasses.replace(fit_factors(target, experts, top_k, hidden, token_pick, sim_sequences),
                                      accept_gain=1.0, embed_scale=embed_scale, clear_routing=clear_routing)
    else:
        profile = RoutingProfile(factors, token_weight=1.0, accept_gain=1.0, embed_scale=embed_scale,
                                 clear_routing=clear_routing, token_pick=token_pick)
    profile, (model, prompts, walks, curves) = correct_by_builds(spec, layers, profile, target, rounds, per_dataset,
                                                                 seed, device, dtype, step, sim_sequences)
    if direct:
        del model
        profile = refine_on_build(spec, layers, profile, target, per_dataset, seed, direct, device, dtype)
        model, prompts, walks, curves = probe_build(spec, layers, profile, per_dataset, seed, device, dtype)
    ratios = np.concatenate([rejection_ratios(model, p, w, seed) for p, w in zip(prompts, walks)])
    n_moe = moe_layer_count(hf_config(model.spec))
    accept_gain = fit_gain(ratios, TARGET_ACCEPTANCE.get(spec.name, 0.965)) * math.sqrt(n_moe)
    largest, mean = calibration_error(curves, target)
    distinct = min(len(set(w[:64])) for w in walks)
    fitted = dataclasses.replace(profile, accept_gain=round(accept_gain, 4), source=f"routing-locality.tsv: {real}",
                                 target=tuple((f"{p}@{r:g}", v) for (p, r), v in target.items()))
    return {"model": spec.name, "real": real, "layers": layers, "profile": fitted,
            "measured": {f"{p}@{r:g}": round(v, 3) for (p, r), v in curves.items()},
            "max_error": round(largest, 3), "mean_error": round(mean, 3), "min_distinct_per_64": distinct,
            "lru1_by_layer": lru_by_layer(model, prompts, walks)}


def measure_committed(name: str, layers: int | None, per_dataset: int, seed: int, device: str,
                      dtype: torch.dtype, clear_routing: bool = False, token_pick: float | None = None) -> dict:
    """The registry's committed profile of `name`, built as is (or with `clear_routing` set, or another
    `token_pick`): its curves against the real row."""
    spec = get_spec(name)
    target = {p: v for p, v in reference_curves(REAL_NAMES.get(spec.name, REAL_NAMES["mixtral"])).items()
              if p in FIT_POINTS}
    profile = spec.routing_profile
    profile = dataclasses.replace(profile, clear_routing=clear_routing or profile.clear_routing,
                                  token_pick=profile.token_pick if token_pick is None else token_pick)
    model, prompts, walks, curves = probe_build(spec, layers, profile, per_dataset, seed, device, dtype)
    by_layer = lru_by_layer(model, prompts, walks)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    largest, mean = calibration_error(curves, target)
    return {"model": spec.name, "layers": layers, "profile": profile,
            "measured": {f"{p}@{r:g}": round(v, 3) for (p, r), v in curves.items()},
            "max_error": round(largest, 3), "mean_error": round(mean, 3),
            "min_distinct_per_64": min(len(set(w[:64])) for w in walks), "lru1_by_layer": by_layer}


def factor(text: str) -> tuple[float, float]:
    """`weight:run_length` (run length `inf`: a popularity) as a (weight, run length) pair."""
    try:
        weight, run = (float(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a factor is WEIGHT:RUN_LENGTH, e.g. 0.8:50 or 0.6:inf; got {text!r}")
    if weight < 0 or not run > 0:
        raise argparse.ArgumentTypeError(f"a factor needs weight >= 0 and run length > 0; got {text!r}")
    return weight, run


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny-mixtral", "dsv2", "qwen", "phi", "mixtral"])
    parser.add_argument("--layers", type=int, default=None, help="depth of the full-size probes (default 4; phi "
                        "and mixtral 2; 0 = the real depth)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--check-dtype", choices=("float16", "bfloat16", "float32"), default=None,
                        help="then build the fitted model at its real depth in this dtype on --device and report "
                             "Specter's acceptance and agreement with the greedy target there")
    parser.add_argument("--check-gptq", action="store_true",
                        help="with --check-dtype: also a GPTQ draft's acceptance (calibrated on other prompts)")
    parser.add_argument("--check-layers", type=int, default=None,
                        help="with --check-dtype: build the check this many layers deep (default: the real depth)")
    parser.add_argument("--direct", type=int, default=0,
                        help="then refine three factors on this many builds on --device in --dtype (tiny models "
                             "on a CPU: seconds each; phi at its real depth on an H200: about a minute each)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="corrections of the fit by the build's measured offset (a build each; default 1, "
                             "0 with --factors)")
    parser.add_argument("--step", type=float, default=1.0,
                        help="share of the build's error each correction moves the simulated target by")
    parser.add_argument("--check-only", action="store_true",
                        help="fit nothing: measure the registry's committed profile (and --check-dtype)")
    parser.add_argument("--factors", nargs="+", type=factor, default=None, metavar="WEIGHT:RUN",
                        help="build these routing factors as given (run length in tokens, inf: a popularity) "
                             "and fit only their gain; with --rounds, start the corrections from them")
    parser.add_argument("--clear-routing", action="store_true",
                        help="build with clear_routing (no attention or expert output in the routing subspace): "
                             "the fitted profile, or with --check-only the registry's")
    parser.add_argument("--token-pick", type=float, default=None, metavar="WEIGHT",
                        help="build with this token pick (RoutingProfile.token_pick): the fitted profile's "
                             "(default 0), or with --check-only instead of the registry's")
    parser.add_argument("--sim-sequences", type=int, default=8,
                        help="walks of 128 tokens the routing simulation averages (more: steadier, slower fits)")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per dataset")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--embed-scale", type=float, default=None,
                        help="embedding RMS (default: 1 for tiny models, 12 for full-size ones)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.sim_sequences < 1:
        parser.error("--sim-sequences must be at least 1")
    results = []
    for name in args.models:
        spec = get_spec(name)
        default = 2 if spec.name in ("phi", "mixtral") else 4
        layers = None if spec.is_tiny or args.layers == 0 else (args.layers or default)
        scale = args.embed_scale or (1.0 if spec.is_tiny else FULL_EMBED_SCALE)
        rounds = args.rounds if args.rounds is not None else (0 if args.factors else 1)
        if args.check_only:
            result = measure_committed(name, layers, args.prompts, args.seed, args.device, getattr(torch, args.dtype),
                                       args.clear_routing, args.token_pick)
        else:
            result = fit_model(name, layers, args.prompts, args.seed, scale, args.device, getattr(torch, args.dtype),
                               args.direct, rounds, args.step, args.factors and tuple(args.factors), args.clear_routing,
                               args.token_pick or 0.0, args.sim_sequences)
        if args.check_dtype:
            result["check"] = check_in(getattr(torch, args.check_dtype), spec, result["profile"], args.prompts,
                                       args.seed, args.device, args.check_gptq, args.check_layers)
        results.append(result)
        print(f"{name}: max error {result['max_error']}, mean {result['mean_error']}, "
              f"distinct/64 >= {result['min_distinct_per_64']}\n  measured {result['measured']}\n  {result['profile']}"
              f"\n  LRU@1 by MoE layer: {result.get('lru1_by_layer')}\n  check: {result.get('check')}",
              flush=True)
    if args.out:
        args.out.write_text(json.dumps([{**r, "profile": repr(r["profile"])} for r in results], indent=2))


if __name__ == "__main__":
    main()
