"""Calibrated weights: the real checkpoints' routing locality, acceptance and margins, from seeded weights."""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import DynamicCache

import specter
from experiments.datasets import data_dir, prompts_for
from experiments.locality import calibration_error, locality_curves, reference_curves
from experiments.routing_trace import committed_routing, topk_recall
from specter.errors import SpecterError
from specter.models.calibrated import (
    quiet_writer,
    LAYOUT_SEED,
    acceptance_direction,
    orthonormal_router_rows,
    residual_layout,
    routers,
    token_picks,
    writes_cleared,
)
from specter.models.host_experts import build_synthetic_on_host
from specter.models.hybrid import hybridize
from specter.models.loading import build_synthetic, hf_config, with_layers
from specter.models.registry import get_spec
from specter.models.tokenizer import ByteTokenizer
from specter.quant.gptq import quantize_experts_gptq

FIT_POINTS = (("LRU", 0.5), ("LRU", 1.0), ("LRU", 2.0), ("LRU", 4.0), ("Belady", 1.0), ("Belady", 2.0))


@functools.lru_cache(maxsize=None)
def calibrated(name: str = "tiny-mixtral", layers: int | None = None) -> specter.HybridMoEModel:
    return specter.load_model(name, weights="calibrated", num_layers=layers, device="cpu", dtype=torch.float32)


def local_prompts(model, per_dataset: int = 2) -> list[torch.Tensor]:
    """The first prompts of the local GSM8K, WikiText-2 and HumanEval files, cut to 16 tokens."""
    if not (data_dir() / "gsm8k" / "test.jsonl").is_file():
        pytest.skip(f"the local datasets are not at {data_dir()} (set SPECTER_DATA to the shared data directory)")
    out = []
    for name in ("gsm8k", "wikitext2", "humaneval"):
        cfg = OmegaConf.create({"name": name, "members": [name], "path": None, "source": "local"})
        out += [torch.tensor([model.tokenizer(t)["input_ids"][:16]]) for t in prompts_for(cfg, per_dataset)[name]]
    return out


@torch.inference_mode()
def greedy(model, prompt: torch.Tensor, tokens: int) -> list[int]:
    cache, ids, out = DynamicCache(config=model.hf.config), prompt, []
    for _ in range(tokens):
        out.append(int(model.forward(ids, cache)[0, -1].argmax()))
        ids = torch.tensor([[out[-1]]])
    return out


@torch.inference_mode()
def greedy_together(model, prompts: list[torch.Tensor], tokens: int) -> list[list[int]]:
    """`greedy` of equally long prompts, decoded as one batch (one LM-head GEMM per step for all)."""
    ids = torch.cat(prompts)  # [B, T]
    cache, out = DynamicCache(config=model.hf.config), []
    for _ in range(tokens):
        out.append(model.forward(ids, cache)[:, -1].argmax(-1))  # [B]
        ids = out[-1][:, None]
    return torch.stack(out, dim=1).tolist()  # [B, tokens]


def fit_points(model, prompts, walks):
    traces = [layer for p, w in zip(prompts, walks) for layer in committed_routing(model, p, w)]
    return locality_curves(traces, model.top_k, policies=("LRU", "Belady"), rhos=(0.5, 1.0, 2.0, 4.0))


def real_row(name: str) -> dict:
    return {p: v for p, v in reference_curves(name).items() if p in FIT_POINTS}


def test_full_precision_tensors_never_write_along_the_acceptance_direction():
    model = calibrated()
    g = acceptance_direction(model.hf.config.hidden_size, seed=0)
    ids = local_prompts(model, 1)[0]
    states = {}
    handle = model.hf.model.norm.register_forward_pre_hook(lambda m, a: states.__setitem__("h", a[0][0]))
    try:
        for mode in ("target", "draft"):
            model.forward(ids, DynamicCache(config=model.hf.config), mode=mode)
            states[mode] = (states["h"] @ g).abs().max() / states["h"].norm(dim=-1).max()
    finally:
        handle.remove()
    assert states["target"] < 1e-5  # float32 rounding only
    assert states["draft"] > 1e-3  # the INT4 draft's down-projection error


def test_calibrated_build_is_seeded_and_differs_from_synthetic():
    spec = get_spec("tiny-mixtral")
    a = build_synthetic(spec, torch.device("cpu"), torch.float32, 0, calibrated=True)
    b = build_synthetic(spec, torch.device("cpu"), torch.float32, 0, calibrated=True)
    plain = build_synthetic(spec, torch.device("cpu"), torch.float32, 0)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert not torch.equal(a.lm_head.weight, plain.lm_head.weight)


def test_specter_on_calibrated_weights_is_the_target_greedy_walk_without_loops():
    model = calibrated()
    engine = specter.SpecterEngine(model, specter.SpecterConfig(k=4, resident_experts_per_layer=2))
    for ids in local_prompts(model, 1):
        walk = greedy(model, ids, 64)
        assert engine.generate(ids, 64).token_ids == walk
        assert len(set(walk)) >= 32  # at least 32 distinct tokens per 64: no short loops


@pytest.mark.slow
def test_tiny_mixtral_reproduces_the_mixtral_row_and_acceptance():
    model = calibrated()
    prompts = local_prompts(model, 2)  # 6 prompts x 128 tokens
    walks = [greedy(model, p, 128) for p in prompts]
    largest, mean = calibration_error(fit_points(model, prompts, walks), real_row("Mixtral-8x7B-v0.1"))
    assert largest <= 0.04 and mean <= 0.03, (largest, mean)
    engine = specter.SpecterEngine(model, specter.SpecterConfig(k=4))
    results = [engine.generate(p, 128) for p in prompts]
    assert [r.token_ids for r in results] == walks
    acceptance = np.mean([r.stats["acceptance_rate"] for r in results])
    assert 0.94 <= acceptance <= 0.99, acceptance  # fitted to 0.965 (RTN)
    recall = topk_recall(*[[layer for p, w in zip(prompts, walks) for layer in committed_routing(model, p, w, mode)]
                           for mode in ("draft", "target")])
    assert 0.9 <= recall < 1.0, recall  # the draft routes differently only through its INT4 error


@pytest.mark.slow
def test_gptq_draft_keeps_acceptance_in_range():
    model = specter.load_model("tiny-mixtral", weights="calibrated", device="cpu", dtype=torch.float32)
    prompts = local_prompts(model, 2)
    walks = [greedy(model, p, 128) for p in prompts]
    quantize_experts_gptq(model, [torch.cat([p, torch.tensor([w])], dim=1) for p, w in zip(prompts, walks)])
    engine = specter.SpecterEngine(model, specter.SpecterConfig(k=4))
    results = [engine.generate(p, 128) for p in prompts[::2]]  # one prompt per dataset
    assert [r.token_ids for r in results] == walks[::2]
    assert np.mean([r.stats["acceptance_rate"] for r in results]) >= 0.94


@pytest.mark.slow
def test_full_width_dsv2_reproduces_the_deepseek_row():
    model = calibrated("dsv2", layers=2)  # one dense and one MoE layer, full width (64 experts, top-6)
    assert model.num_moe_layers == 1 and model.num_experts == 64 and model.hf.config.hidden_size == 2048
    prompts = local_prompts(model, 2)
    assert len({p.shape[1] for p in prompts}) == 1  # all cut to 16 tokens: one batch
    walks = greedy_together(model, prompts, 128)
    assert walks[0][:16] == greedy(model, prompts[0], 16)  # a batch row decodes as the prompt alone
    largest, mean = calibration_error(fit_points(model, prompts, walks), real_row("DeepSeek-V2-Lite"))
    assert largest <= 0.04 and mean <= 0.03, (largest, mean)
    assert min(len(set(w[:64])) for w in walks) >= 32


def test_weights_arguments_are_checked():
    with pytest.raises(SpecterError, match="weights must be one of"):
        specter.load_model("tiny-mixtral", weights="random", device="cpu")
    with pytest.raises(SpecterError, match="contradicts"):
        specter.load_model("tiny-mixtral", synthetic=False, weights="calibrated", device="cpu")
    with pytest.raises(SpecterError, match="no calibrated routing profile"):
        specter.load_model("tiny-qwen", weights="calibrated", device="cpu")
    with pytest.raises(SpecterError, match="integer above 1"):
        with_layers(get_spec("dsv2"), 1)
    with pytest.raises(SpecterError, match="needs synthetic or calibrated"):
        specter.load_model("dsv2", num_layers=4, device="cpu")  # would load the checkpoint
    assert hf_config(with_layers(get_spec("dsv2"), 4)).num_hidden_layers == 4


def test_experts_built_straight_into_host_memory_walk_the_same_cycle():
    host = specter.load_model("tiny-mixtral", weights="calibrated", experts_on_host=True, device="cpu",
                              dtype=torch.float32)
    engine = specter.SpecterEngine(host, specter.SpecterConfig(k=4, resident_experts_per_layer=2))
    ids = local_prompts(host, 1)[0]
    assert engine.generate(ids, 48).token_ids == greedy(calibrated(), ids, 48)  # embeddings and head are shared
    g = acceptance_direction(host.hf.config.hidden_size, seed=0)
    down = host.host_store.layer_weights(0)[1]  # [E, H, I]
    assert torch.einsum("h,ehi->ei", g, down.float()).abs().max() < 1e-5


def test_host_built_experts_follow_cleared_routing_and_token_picks():
    """The experts-on-host build lays out routers and embeddings as the resident build does, and its host
    experts' down projections leave the routing subspace too."""
    spec = get_spec("tiny-mixtral")
    spec = dataclasses.replace(spec, routing_profile=dataclasses.replace(spec.routing_profile, clear_routing=True,
                                                                         token_pick=0.5))
    words = ByteTokenizer(spec.hf_config["vocab_size"])
    resident = build_synthetic(spec, torch.device("cpu"), torch.float32, 0, calibrated=True)
    host = build_synthetic_on_host(spec, hf_config(spec), words, torch.device("cpu"), torch.float32, 0, True)
    hidden = resident.config.hidden_size
    assert torch.equal(resident.get_input_embeddings().weight, host.hf.get_input_embeddings().weight)
    pairs = list(zip(routers(resident, hidden), routers(host.hf, hidden)))
    assert len(pairs) == resident.config.num_hidden_layers
    assert all(torch.equal(a.weight, b.weight) for a, b in pairs)
    rows = torch.cat([b.weight for _, b in pairs])  # [L*E, H]: mutually orthogonal with a pick
    gram = rows @ rows.T
    assert torch.allclose(gram, torch.diag(torch.diag(gram)), atol=1e-6)
    layout = residual_layout(hidden, torch.Generator().manual_seed(0 + LAYOUT_SEED))
    down = host.host_store.layer_weights(0)[1].float()  # [E, H, I]
    assert torch.einsum("hr,ehi->eri", layout.routing, down).abs().max() < 1e-5


def test_depth_override_keeps_the_width():
    model = specter.load_model("tiny-mixtral", weights="calibrated", num_layers=2, device="cpu", dtype=torch.float32)
    assert model.num_moe_layers == 2 and model.spec.hf_config["num_hidden_layers"] == 2
    assert dataclasses.asdict(model.spec)["hf_config"]["hidden_size"] == 128


@pytest.mark.parametrize("clear_routing", [False, True])
def test_residual_writers_stay_out_of_g_and_with_clear_routing_out_of_the_routing_subspace(clear_routing):
    """Every attention output and expert down projection of a calibrated build has no component along g;
    with `clear_routing` none in the routing subspace either (without it, they do write there)."""
    spec = get_spec("tiny-mixtral")
    spec = dataclasses.replace(spec, routing_profile=dataclasses.replace(spec.routing_profile,
                                                                         clear_routing=clear_routing))
    model = build_synthetic(spec, torch.device("cpu"), torch.float32, seed=0, calibrated=True)
    hidden = model.config.hidden_size
    layout = residual_layout(hidden, torch.Generator().manual_seed(0 + LAYOUT_SEED))
    writers = [(n, p) for n, p in model.named_parameters() if n.endswith(("o_proj.weight", "down_proj"))]
    assert len(writers) >= 2 * model.config.num_hidden_layers
    for name, param in writers:
        out = param.movedim(1 if name.endswith("down_proj") else 0, -1)  # [..., H]
        assert (out @ layout.g).abs().max() < 1e-5, name
        into_routing = (out @ layout.routing).norm() / out.norm()
        assert (into_routing < 1e-5) if clear_routing else (into_routing > 0.1), (name, float(into_routing))


def test_writes_cleared_removes_the_routing_subspace_only_when_asked():
    layout = residual_layout(64, torch.Generator().manual_seed(3))
    weight = torch.randn(5, 64, 7)  # [E, H, I]
    profile = get_spec("tiny-mixtral").routing_profile
    kept = writes_cleared(layout, profile)(weight, 1)
    cleared = writes_cleared(layout, dataclasses.replace(profile, clear_routing=True))(weight, 1)
    for w in (kept, cleared):
        assert (w.movedim(1, -1) @ layout.g).abs().max() < 1e-5
    assert (kept.movedim(1, -1) @ layout.routing).abs().max() > 0.1
    assert (cleared.movedim(1, -1) @ layout.routing).abs().max() < 1e-5
    assert torch.allclose(cleared.movedim(1, -1) @ layout.token, weight.movedim(1, -1) @ layout.token, atol=1e-5)


def test_token_picks_push_one_expert_of_every_layer():
    rows = orthonormal_router_rows(3, 4, 16, torch.Generator().manual_seed(0))  # [L, E, d_r]
    assert torch.allclose(rows.reshape(12, 16) @ rows.reshape(12, 16).T, torch.eye(12), atol=1e-5)
    picks = token_picks(10, rows, torch.Generator().manual_seed(1))  # [T, d_r]
    reads = torch.einsum("td,led->tle", picks, rows)  # [T, L, E]: what each layer's routers read of a pick
    assert torch.allclose(reads.sum(-1), torch.ones(10, 3), atol=1e-5)
    assert torch.allclose(reads.amax(-1), torch.ones(10, 3), atol=1e-5)
    assert len({tuple(r) for r in reads.argmax(-1).tolist()}) > 1  # random experts, per token and layer
    with pytest.raises(SpecterError, match="token_pick needs MoE layers x experts"):
        orthonormal_router_rows(5, 4, 16, torch.Generator())


def reuse_by_rank(traces) -> list[float]:
    """P(the rank-r expert of token t is among token t+1's experts), for each rank r."""
    reused = np.zeros(len(traces[0][0]))
    pairs = 0
    for trace in traces:
        for now, after in zip(trace, trace[1:]):
            reused += [e in after for e in now]
            pairs += 1
    return list(reused / pairs)


@pytest.mark.parametrize("token_pick", [0.0, 3.0])
def test_a_token_pick_makes_the_second_ranked_expert_the_more_reused(token_pick):
    """Phi-3.5-MoE's row: the next token reuses a token's second-ranked expert more often than its first.
    A strong pick takes rank 1 (a random expert per token), leaving rank 2 to the slowly varying part."""
    spec = get_spec("tiny-mixtral")
    profile = dataclasses.replace(spec.routing_profile, factors=((1.0, 30.0),), token_weight=0.3,
                                  clear_routing=True, token_pick=token_pick)
    spec = dataclasses.replace(spec, routing_profile=profile)
    model = hybridize(build_synthetic(spec, torch.device("cpu"), torch.float32, 0, calibrated=True), spec,
                      ByteTokenizer(spec.hf_config["vocab_size"]))
    prompt = torch.tensor([model.tokenizer("def f(x):")["input_ids"]])
    traces = committed_routing(model, prompt, greedy(model, prompt, 96))
    first, second = reuse_by_rank(traces)
    assert (second > first + 0.2) if token_pick else (first > second + 0.1), (first, second)


@pytest.mark.parametrize("name, quiet", [
    ("model.layers.0.self_attn.o_proj.weight", True), ("model.layers.3.mlp.shared_expert.down_proj.weight", True),
    ("model.layers.3.mlp.shared_experts.down_proj.weight", True), ("model.layers.0.mlp.down_proj.weight", True),
    ("model.layers.0.self_attn.o_proj.bias", True), ("model.layers.3.mlp.experts.down_proj", False),
    ("model.layers.3.mlp.experts.7.down_proj.weight", False), ("model.layers.3.mlp.gate.weight", False)])
def test_quiet_writers_are_the_full_precision_writers_no_draft_quantizes(name, quiet):
    assert quiet_writer(name) == quiet


def test_in_bfloat16_only_routed_experts_write_on_the_acceptance_coordinates():
    """Attention (and shared or dense MLPs) write exact zeros on g's coordinates, so no 16-bit rounding of
    theirs lands on g; the routed experts, which the draft quantizes, still write there (off g itself)."""
    model = specter.load_model("tiny-mixtral", weights="calibrated", dtype=torch.bfloat16, device="cpu")
    g = acceptance_direction(model.hf.config.hidden_size, seed=0)
    own = g.nonzero().flatten()
    params = dict(model.hf.named_parameters())
    quiet = [n for n in params if quiet_writer(n)]
    assert len(quiet) >= model.hf.config.num_hidden_layers
    for name in quiet:
        assert not params[name][own].any(), name
    routed = [p for n, p in params.items() if n.endswith("experts.down_proj")]  # [E, H, I]
    assert routed and all(p[:, own].abs().amax() > 0 for p in routed)
