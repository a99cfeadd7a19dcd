"""Checkpoints laid out exactly as the four real Hub repositories (tests/hub_checkpoints.py), loaded the way a user
loads a download: per-expert bfloat16 shards, old-format rope_scaling, remote-code auto_map, the repository's own
tokenizer. Float32 on the CPU; greedy Specter output must equal HF generate token for token."""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file

import specter
from baselines.export import save_checkpoint
from baselines.target_only import TargetOnly
from initialization import quantize_draft
from specter.errors import SpecterError
from specter.models.registry import PHI_LONG_FACTOR, PHI_MSCALE, PHI_SHORT_FACTOR
from specter.models.tokenizer import ByteTokenizer
from specter.quant.gptq import target_layer_weights
from tests.hub_checkpoints import drop_shard, read_index, shard_files, truncate_shard, write_hub_checkpoint
from tests.hub_configs import ARCHS, DSV2_ROPE_SCALING, MODEL_TYPES, NUM_EXPERTS, REAL_VALUES
from tests.hub_tokenizers import CORPUS, DSV2_BOS, DSV2_EOS, break_tokenizer, raw_tokenizer, tokenizer_files

NEW = 24
SLOTS = NUM_EXPERTS // 2
PROMPTS = ["The keeper climbed the narrow stairs to light the lamp",  # words the tokenizer was trained on
           "Le café coûte 3,50 € depuis 1987, dit-il."]  # unseen words, digits, non-ASCII (byte fallback)
EXPECTED_SPECIALS = {  # (bos, eos) tokens the config ids must name, as in the real repositories
    "dsv2": (DSV2_BOS, DSV2_EOS),
    "qwen": ("<|endoftext|>", "<|endoftext|>"),
    "phi": ("<s>", "<|endoftext|>"),
    "mixtral": ("<s>", "</s>"),
}
ADDS_BOS = {"dsv2": True, "qwen": False, "phi": False, "mixtral": True}
REPOS_DIR = {"dsv2": "DeepSeek-V2-Lite", "qwen": "Qwen1.5-MoE-A2.7B", "phi": "Phi-3.5-MoE-instruct",
             "mixtral": "Mixtral-8x7B-v0.1"}


@pytest.fixture(scope="module", params=ARCHS)
def hub(request, tmp_path_factory) -> tuple[str, Path]:
    """(arch, directory) of a freshly written checkpoint, one per arch for the whole module (never modified)."""
    arch = request.param
    return arch, write_hub_checkpoint(arch, tmp_path_factory.mktemp(f"hub-{arch}") / REPOS_DIR[arch])


def config_json(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


@functools.lru_cache(maxsize=None)
def hf_tokenizer(directory: Path):
    return transformers.AutoTokenizer.from_pretrained(directory)


def encode(directory: Path, text: str) -> torch.Tensor:
    return torch.tensor([hf_tokenizer(directory)(text)["input_ids"]])


@functools.lru_cache(maxsize=None)
def hf_model(directory: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=None)
def hf_greedy(directory: Path, text: str, new: int = NEW) -> tuple[int, ...]:
    """HF's own greedy tokens (float32) for `new` tokens: the repositories' generation configs sample (DeepSeek)
    and stop at eos, both switched off here as in every comparison of the compared systems."""
    model = hf_model(directory)
    model.generation_config.eos_token_id = None
    ids = encode(directory, text)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                         pad_token_id=0)
    return tuple(out[0, ids.shape[1]:].tolist())


def written_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in shard_files(directory):
        tensors.update(load_file(str(directory / shard)))
    return tensors


def moe_layers(arch: str, config: dict) -> list[int]:
    first = config.get("first_k_dense_replace", 0) if arch == "dsv2" else 0
    return list(range(first, config["num_hidden_layers"]))


def expert_names(arch: str, layer: int, expert: int) -> tuple[str, str, str]:
    """Hub names of one routed expert's (gate, up, down) weights."""
    if arch in ("phi", "mixtral"):
        base = f"model.layers.{layer}.block_sparse_moe.experts.{expert}"
        return f"{base}.w1.weight", f"{base}.w3.weight", f"{base}.w2.weight"
    base = f"model.layers.{layer}.mlp.experts.{expert}"
    return f"{base}.gate_proj.weight", f"{base}.up_proj.weight", f"{base}.down_proj.weight"


def fused_from_written(arch: str, tensors: dict, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The written per-expert tensors of one layer in transformers' fused layout: gate_up [E, 2I, H], down [E, H, I]."""
    gate_up, down = [], []
    for e in range(NUM_EXPERTS):
        g, u, d = (tensors[n].float() for n in expert_names(arch, layer, e))
        gate_up.append(torch.cat([g, u]))
        down.append(d)
    return torch.stack(gate_up), torch.stack(down)


# --- the directory looks like the Hub ----------------------------------------------------------------------


def test_layout_is_the_hubs(hub):
    arch, d = hub
    config, index = config_json(d), read_index(d)
    shards = shard_files(d)
    assert len(shards) >= 2
    digits = 6 if arch == "dsv2" else 5  # DeepSeek-V2-Lite: model-00001-of-000004.safetensors
    assert all(re.fullmatch(rf"model-\d{{5}}-of-\d{{{digits}}}\.safetensors", s) for s in shards), shards
    expected_files = {"config.json", "generation_config.json", "model.safetensors.index.json", *shards,
                      *tokenizer_files(arch)}
    assert {p.name for p in d.iterdir()} == expected_files

    total = 0
    for shard in shards:
        with safe_open(str(d / shard), "pt") as f:
            assert set(f.keys()) == {k for k, v in index["weight_map"].items() if v == shard}
            assert f.metadata() == {"format": "pt"}
            for key in f.keys():
                piece = f.get_slice(key)
                assert piece.get_dtype() == "BF16", key
                total += 2 * int(torch.tensor(piece.get_shape()).prod())
    assert index["metadata"]["total_size"] == total

    names = set(index["weight_map"])
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names)  # no fused tensors
    for layer in moe_layers(arch, config):
        for e in range(NUM_EXPERTS):
            assert set(expert_names(arch, layer, e)) <= names, (layer, e)
        prefix = f"model.layers.{layer}." + ("block_sparse_moe" if arch in ("phi", "mixtral") else "mlp")
        assert f"{prefix}.gate.weight" in names
        if arch == "dsv2":
            assert f"{prefix}.shared_experts.gate_proj.weight" in names
        if arch == "qwen":
            assert {f"{prefix}.shared_expert.down_proj.weight", f"{prefix}.shared_expert_gate.weight"} <= names
    if arch == "dsv2":  # first_k_dense_replace = 1: layer 0 is a dense MLP
        assert "model.layers.0.mlp.gate_proj.weight" in names
        assert not any(n.startswith("model.layers.0.mlp.experts.") for n in names)

    assert config["torch_dtype"] == "bfloat16" and "dtype" not in config and "rope_parameters" not in config
    assert config["rope_theta"] == REAL_VALUES[arch]["rope_theta"]
    assert ("auto_map" in config) == (arch in ("dsv2", "phi"))
    if arch == "dsv2":
        assert config["rope_scaling"] == DSV2_ROPE_SCALING and config["q_lora_rank"] is None
        assert config["auto_map"]["AutoConfig"] == "configuration_deepseek.DeepseekV2Config"
        assert config["first_k_dense_replace"] == 1 and len(moe_layers(arch, config)) >= 2
    elif arch == "phi":
        scaling = config["rope_scaling"]
        half = config["hidden_size"] // config["num_attention_heads"] // 2
        assert scaling["type"] == "longrope" and "rope_type" not in scaling
        assert len(scaling["long_factor"]) == len(scaling["short_factor"]) == half
        assert scaling["long_factor"][0] == PHI_LONG_FACTOR[0] and scaling["long_factor"][-1] == PHI_LONG_FACTOR[-1]
        assert set(scaling["long_factor"]) <= set(PHI_LONG_FACTOR)
        assert set(scaling["short_factor"]) <= set(PHI_SHORT_FACTOR)
        assert scaling["long_mscale"] == scaling["short_mscale"] == PHI_MSCALE
        assert scaling["original_max_position_embeddings"] == config["original_max_position_embeddings"] == 4096
        assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_phimoe.PhiMoEForCausalLM"
    else:
        assert "rope_scaling" not in config
    if arch == "qwen":
        assert config["sliding_window"] == 32768 and config["use_sliding_window"] is False

    raw = raw_tokenizer(arch)
    bos, eos = EXPECTED_SPECIALS[arch]
    assert raw.id_to_token(config["bos_token_id"]) == bos and raw.id_to_token(config["eos_token_id"]) == eos
    assert config["vocab_size"] % 64 == 0 and config["vocab_size"] >= raw.get_vocab_size()
    generation = json.loads((d / "generation_config.json").read_text())
    eos_ids = generation["eos_token_id"]
    assert config["eos_token_id"] in (eos_ids if isinstance(eos_ids, list) else [eos_ids])


def test_transformers_reads_the_hub_format(hub):
    """What transformers does with these files: auto_map ignored without trust_remote_code, old rope_scaling
    mapped to rope_parameters, per-expert tensors fused into gate_up_proj / down_proj exactly."""
    arch, d = hub
    config = transformers.AutoConfig.from_pretrained(d)
    assert type(config).__module__.startswith(f"transformers.models.{MODEL_TYPES[arch]}.")
    rope = config.rope_parameters
    if arch == "dsv2":
        assert rope["rope_type"] == "yarn" and rope["rope_theta"] == 10000
        assert {k: rope[k] for k in DSV2_ROPE_SCALING if k != "type"} == {
            k: v for k, v in DSV2_ROPE_SCALING.items() if k != "type"}
    elif arch == "phi":
        written = config_json(d)["rope_scaling"]
        assert rope["rope_type"] == "longrope" and rope["rope_theta"] == 10000.0
        assert rope["long_factor"] == written["long_factor"] and rope["short_factor"] == written["short_factor"]
        assert rope["long_mscale"] == rope["short_mscale"] == PHI_MSCALE
        assert rope["original_max_position_embeddings"] == config.original_max_position_embeddings == 4096
    else:
        assert rope["rope_type"] == "default" and rope["rope_theta"] == 1000000.0

    model, info = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    state, tensors = model.state_dict(), written_tensors(d)
    assert torch.equal(state["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"].float())
    for layer in moe_layers(arch, config_json(d)):
        gate_up, down = fused_from_written(arch, tensors, layer)
        (key,) = [k for k in state if k.startswith(f"model.layers.{layer}.") and k.endswith("experts.gate_up_proj")]
        assert torch.equal(state[key], gate_up), key
        assert torch.equal(state[key.replace("gate_up_proj", "down_proj")], down), key


# --- Specter loads it -------------------------------------------------------------------------------------


@pytest.mark.parametrize("on_host", [False, True], ids=["resident", "experts_on_host"])
def test_specter_loads_with_the_repositorys_tokenizer(hub, on_host):
    arch, d = hub
    model = specter.load_model(d, dtype=torch.float32, experts_on_host=on_host)
    assert model.dtype == torch.float32 and (model.host_store is not None) == on_host
    assert not isinstance(model.tokenizer, ByteTokenizer), type(model.tokenizer)
    raw = raw_tokenizer(arch)
    for text in PROMPTS:
        ids = model.tokenizer(text)["input_ids"]
        assert ids == hf_tokenizer(d)(text)["input_ids"]
        assert ids == raw.encode(text).ids  # the trained tokenizer itself, with the repository's bos rule
        assert (ids[0] == config_json(d)["bos_token_id"]) == ADDS_BOS[arch]
        assert model.tokenizer.decode(ids, skip_special_tokens=True).strip() == text
    assert model.tokenizer.eos_token_id == config_json(d)["eos_token_id"]
    tensors = written_tensors(d)
    for module, layer in zip(model.experts, moe_layers(arch, config_json(d)), strict=True):
        gate_up, down = target_layer_weights(model, module)
        want_gate_up, want_down = fused_from_written(arch, tensors, layer)
        assert torch.equal(gate_up.float().cpu(), want_gate_up) and torch.equal(down.float().cpu(), want_down)


def test_greedy_equals_hf_generate(hub):
    arch, d = hub
    model = specter.load_model(d, dtype=torch.float32, experts_on_host=True)
    engine = specter.SpecterEngine(model, specter.SpecterConfig(k=4, resident_experts_per_layer=SLOTS))
    rates = []
    for text in PROMPTS:
        out = engine.generate(encode(d, text), NEW)
        reference = hf_greedy(d, text)
        assert out.token_ids == list(reference), (arch, text)
        assert len(set(reference)) > 4, "the fixture's greedy text collapsed into a few tokens"
        assert out.stats["misses"] > 0
        rates.append(out.stats["acceptance_rate"])
    assert min(rates) < 1.0, "no draft was ever rejected: the equality above would not exercise rollback"


def test_gptq_draft_round_trip(hub, tmp_path):
    """quantize_draft.py on the checkpoint (its tokenizer tokenizes the calibration text), then
    load_model(..., draft=DIR): the loaded draft is exactly the written one, and decoding stays lossless."""
    arch, d = hub
    corpus, out = tmp_path / "corpus.txt", tmp_path / "draft"
    corpus.write_text(CORPUS)
    argv = ["--model", str(d), "--output", str(out), "--calibration", "text", "--calibration-file", str(corpus),
            "--num-prompts", "4", "--tokens", "64", "--device", "cpu", "--dtype", "float32"]
    assert quantize_draft.main(argv) == 0
    manifest = json.loads((out / "draft.json").read_text())
    assert manifest["quantizer"] == "gptq" and manifest["model_type"] == MODEL_TYPES[arch]
    written = load_file(str(out / "draft.safetensors"))

    model = specter.load_model(d, dtype=torch.float32, experts_on_host=True, draft=out)
    rtn = specter.load_model(d, dtype=torch.float32)
    assert model.quantizer == "gptq" and rtn.quantizer == "rtn"
    differs = False
    for layer, (module, plain) in enumerate(zip(model.experts, rtn.experts, strict=True)):
        for part in ("gate_up", "down"):
            for kind in ("qweight", "scales"):
                loaded = getattr(module, f"draft_{part}_{kind}")
                assert torch.equal(loaded, written[f"experts.{layer}.{part}.{kind}"]), (layer, part, kind)
            differs |= not torch.equal(module.draft_gate_up_qweight, plain.draft_gate_up_qweight)
    assert differs, "the GPTQ draft equals the RTN one: load_model(draft=...) changed nothing visible"
    engine = specter.SpecterEngine(model, specter.SpecterConfig(k=4, resident_experts_per_layer=SLOTS))
    assert engine.generate(encode(d, PROMPTS[0]), NEW).token_ids == list(hf_greedy(d, PROMPTS[0]))


def test_export_after_a_decode(hub, tmp_path):
    """Decode first (rotary caches touched, experts moved to the host store), then export and reload: the
    exported checkpoint decodes like the original, with the repository's tokenizer."""
    arch, d = hub
    model = specter.load_model(d, dtype=torch.float32)
    ids = encode(d, PROMPTS[0])
    engine = specter.SpecterEngine(model, specter.SpecterConfig(k=4, resident_experts_per_layer=SLOTS))
    first = engine.generate(ids, NEW)
    assert first.token_ids == list(hf_greedy(d, PROMPTS[0]))
    save_checkpoint(model, tmp_path / "export")
    reloaded = specter.load_model(tmp_path / "export", dtype=torch.float32)
    assert not isinstance(reloaded.tokenizer, ByteTokenizer)
    assert reloaded.tokenizer(PROMPTS[1])["input_ids"] == hf_tokenizer(d)(PROMPTS[1])["input_ids"]
    assert TargetOnly(reloaded).generate(ids, NEW).token_ids == first.token_ids


# --- Phi-3.5-MoE's longrope switch at original_max_position_embeddings ------------------------------------------


@functools.lru_cache(maxsize=None)
def full_forward_greedy(directory: Path, text: str, new: int = NEW) -> tuple[int, ...]:
    """Greedy tokens of HF's model function itself: every step one forward over the whole sequence, no cache."""
    model, ids = hf_model(directory), encode(directory, text)
    with torch.no_grad():
        for _ in range(new):
            step = model(ids, use_cache=False).logits[0, -1].argmax()
            ids = torch.cat([ids, step.view(1, 1)], dim=1)
    return tuple(ids[0, -new:].tolist())


def test_phi_longrope_switch_stays_lossless(tmp_path):
    """original_max_position_embeddings shrunk to mid-decode and long_mscale != short_mscale: once the sequence is
    longer than the switch, every position (cached ones included) takes the long scaling; Specter must decode
    exactly what the model gives without a cache.

    The reference is not HF generate: in transformers 5.17 PhimoeForCausalLM.prepare_inputs_for_generation drops
    the cache at the switch but still feeds only the newest token (no context from then on)."""
    text = PROMPTS[0]
    default = write_hub_checkpoint("phi", tmp_path / "default")
    prompt_len = encode(default, text).shape[1]
    switch = prompt_len + NEW // 2
    shrunk = write_hub_checkpoint("phi", tmp_path / "shrunk", original_max_position_embeddings=switch,
                                  phi_mscales=(PHI_MSCALE, 1.6))
    assert config_json(shrunk)["rope_scaling"]["original_max_position_embeddings"] == switch
    reference, unswitched = full_forward_greedy(shrunk, text), full_forward_greedy(default, text)
    assert unswitched == hf_greedy(default, text)  # below the switch, HF generate is the model function
    same = switch + 1 - prompt_len  # tokens from forwards whose positions all lie below the switch
    assert reference[:same] == unswitched[:same] and reference != unswitched, "the switch is not visible"
    model = specter.load_model(shrunk, dtype=torch.float32, experts_on_host=True)
    out = specter.SpecterEngine(model, specter.SpecterConfig(k=4, resident_experts_per_layer=SLOTS)).generate(
        encode(shrunk, text), NEW)
    assert out.token_ids == list(reference)
    assert TargetOnly(specter.load_model(shrunk, dtype=torch.float32)).generate(
        encode(shrunk, text), NEW).token_ids == list(reference)


# --- damaged downloads ------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["drop_shard", "truncate_shard", "break_tokenizer"])
@pytest.mark.parametrize("arch", ARCHS)
def test_damaged_checkpoint_is_a_one_line_error(tmp_path, arch, damage):
    """A download missing a shard, with a truncated shard, or without tokenizer files: one SpecterError line
    naming the problem, never a silent fallback (no byte-level or empty tokenizer for a real checkpoint)."""
    d = write_hub_checkpoint(arch, tmp_path / REPOS_DIR[arch])
    if damage == "drop_shard":
        name, match = drop_shard(d).name, "missing"
    elif damage == "truncate_shard":
        name, match = truncate_shard(d).name, "truncated"
    else:
        assert {p.name for p in break_tokenizer(d)} == set(tokenizer_files(arch))
        name, match = None, "tokenizer"
    with pytest.raises(SpecterError, match=match) as error:
        specter.load_model(d, dtype=torch.float32)
    message = str(error.value)
    assert "\n" not in message and (name is None or name in message), message


def test_a_shard_with_a_corrupt_header_is_a_one_line_error(tmp_path):
    d = write_hub_checkpoint("qwen", tmp_path / REPOS_DIR["qwen"])
    shard = d / shard_files(d)[0]
    data = bytearray(shard.read_bytes())
    data[8:40] = b"\xff" * 32  # the JSON header's first bytes
    shard.write_bytes(bytes(data))
    with pytest.raises(SpecterError, match=f"{shard.name} is truncated or corrupt") as error:
        specter.load_model(d, dtype=torch.float32)
    assert "\n" not in str(error.value)
