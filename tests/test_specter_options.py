"""The `specter` config group and SpecterConfig: every option reaches the run, ablations are overrides of the
group, bad values are one-line errors."""
import dataclasses
import math

import pytest
from omegaconf import OmegaConf

from experiments import systems as systems_module
from experiments.settings import DERIVED, model_choice, specter_config, specter_fields
from experiments.systems import build_system, known_systems
from specter.config import SpecterConfig
from specter.errors import SpecterError
from tests.cli import compose_with
from tests.conftest import tiny_model

NON_DEFAULT = {"top_p": 0.9, "prefetch": False, "expert_wise": False, "eviction": "lookahead", "prefetch_victims": "stale",
               "initial_chunk": 3,
               "early_read_fraction": 0.5, "prefetch_chunk": 2, "verify_wave": 2, "load_ahead_layers": 0,
               "copy_streams": 2, "spare_rows": 8, "verify_spare_slots": True, "verify_pooled_slots": 1,
               "cuda_graph": False, "draft_compile": True, "draft_ahead": True, "draft_ahead_branch": True, "draft_ahead_prompt": False,
               "draft_ahead_in_flight": 4,
               "draft_decode_pairs": 0, "residual_transfer": True, "residual_decode_programs": 32,
               "residual_decode_group": 4, "residual_group_copies": True, "host_experts": True, "host_expert_threads": 3,
               "copy_issue": "cudart", "max_cache_len": 512}
SPECTER_SYSTEMS = [name for name in known_systems() if name == "specter" or name.startswith("specter_")]


def test_specter_group_holds_the_dataclass_defaults():
    """conf/specter/default.yaml cannot drift from SpecterConfig: same fields, same values, same types."""
    group = compose_with().specter
    assert list(group) == list(specter_fields())
    defaults = {field.name: field.default for field in dataclasses.fields(SpecterConfig)}
    for name, value in group.items():
        assert (value, type(value)) == (defaults[name], type(defaults[name])), name


def test_every_specter_config_field_is_reachable():
    """Every field is in the `specter` group or derived from a top-level key, never both."""
    fields = {field.name for field in dataclasses.fields(SpecterConfig)}
    assert set(specter_fields()) | set(DERIVED) == fields and not set(specter_fields()) & set(DERIVED)
    assert set(NON_DEFAULT) == set(specter_fields())
    cfg = compose_with("k=3", "mem.slots=2", "temperature=0.5", "seed=7")
    derived = specter_config(cfg, model_choice(cfg).spec)
    assert (derived.k, derived.resident_experts_per_layer, derived.temperature, derived.seed) == (3, 2, 0.5, 7)


@pytest.mark.parametrize("name", sorted(NON_DEFAULT))
def test_every_specter_option_overrides_from_the_command_line(name):
    value = NON_DEFAULT[name]
    text = str(value).lower() if isinstance(value, bool) else value
    cfg = compose_with(f"specter.{name}={text}")
    config = specter_config(cfg, model_choice(cfg).spec)
    assert getattr(config, name) == value and getattr(config, name) != getattr(SpecterConfig(), name)
    assert dataclasses.replace(config, **{name: getattr(SpecterConfig(), name)}) == specter_config(
        compose_with(), model_choice(cfg).spec)  # nothing else changed


@pytest.mark.parametrize("system", SPECTER_SYSTEMS)
def test_specter_variants_are_overrides_of_the_specter_group(system):
    """An ablation file is the Specter factory plus a `specter:` block of group fields, applied on top of the
    run's group: the rest of the run's options reach the ablation unchanged."""
    raw = OmegaConf.load(systems_module.SYSTEM_CONF / f"{system}.yaml")
    assert set(raw) <= {"_target_", "specter"} and raw._target_ == "experiments.systems.make_specter"
    block = dict(raw.get("specter") or {})
    assert set(block) <= set(specter_fields()) and (system == "specter") == (not block)
    cfg = compose_with("specter.top_p=0.9", "specter.spare_rows=8", "specter.eviction=popularity")
    model = tiny_model("tiny")
    run = specter_config(cfg, model.spec)
    built = build_system(system, model, run)
    assert built.config == dataclasses.replace(run, **block)
    assert built.config.top_p == 0.9 and built.config.spare_rows == block.get("spare_rows", 8)
    assert built.config.eviction == block.get("eviction", "popularity")


@pytest.mark.parametrize("override,message", [
    ("+specter.temperature=0.5", "specter.temperature is not a Specter option here: it comes from the top-level"),
    ("+specter.k=2", "specter.k is not a Specter option here: it comes from the top-level k="),
    ("+specter.resident_experts_per_layer=2", "it comes from mem="),
    ("+specter.topp=0.9", "unknown Specter option specter.topp; known: top_p, prefetch,"),
    ("specter.top_p=0", "top_p must be a number in (0, 1], got 0"),
    ("specter.top_p=1.5", "top_p must be a number in (0, 1], got 1.5"),
    ("specter.eviction=fifo", "eviction must be 'lru', 'lookahead' or 'popularity', got 'fifo'"),
    ("specter.spare_rows=-1", "spare_rows must be an integer >= 0, got -1"),
    ("specter.spare_rows=1.5", "spare_rows must be an integer >= 0, got 1.5"),
    ("specter.prefetch=1", "prefetch must be true or false, got 1"),
    ("specter.copy_streams=3", "copy_streams must be 1 or 2, got 3"),
    ("specter.max_cache_len=0", "max_cache_len must be an integer >= 1, got 0"),
    ("k=2.5", "k must be an integer >= 1, got 2.5"),
    ("k=true", "k must be an integer >= 1, got True"),
    ("temperature=-1", "temperature must be a finite number >= 0, got -1"),
    ("temperature=inf", "temperature must be a finite number >= 0, got inf"),
    ("seed=abc", "seed must be an integer, got 'abc'"),
])
def test_bad_specter_option_is_one_line(override, message):
    cfg = compose_with(override)
    with pytest.raises(SpecterError) as err:
        specter_config(cfg, model_choice(cfg).spec)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_specter_block_in_a_system_file_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(systems_module, "SYSTEM_CONF", tmp_path)
    config, model = SpecterConfig(resident_experts_per_layer=2), tiny_model("tiny")
    for name, block, message in (("a", "k: 2", "conf/system/a.yaml: specter.k is not a Specter option here"),
                                 ("b", "spare_row: 0", "conf/system/b.yaml: unknown Specter option specter.spare_row"),
                                 ("c", "spare_rows: -2", "spare_rows must be an integer >= 0, got -2")):
        (tmp_path / f"{name}.yaml").write_text(f"_target_: experiments.systems.make_specter\nspecter:\n  {block}\n")
        with pytest.raises(SpecterError, match=message):
            build_system(name, model, config)


BAD_VALUES = [("k", True), ("k", 2.5), ("k", "4"), ("k", 0), ("resident_experts_per_layer", True),
              ("resident_experts_per_layer", 0), ("temperature", math.nan), ("temperature", math.inf),
              ("temperature", -1), ("temperature", "0"), ("temperature", True), ("top_p", 0), ("top_p", 1.5),
              ("top_p", math.nan), ("top_p", True), ("seed", 1.5), ("seed", True), ("seed", "0"), ("prefetch", 1),
              ("prefetch", "false"), ("expert_wise", None), ("cuda_graph", "yes"), ("draft_compile", 1), ("draft_ahead", "yes"), ("draft_ahead_branch", 1), ("draft_ahead_prompt", "yes"),
              ("draft_ahead_in_flight", -1), ("draft_decode_pairs", -1), ("draft_decode_pairs", 1.5), ("residual_transfer", 1), ("residual_decode_programs", -1),
              ("residual_decode_group", 0), ("residual_group_copies", 1), ("verify_spare_slots", "yes"), ("verify_pooled_slots", -1),
              ("verify_pooled_slots", 1.5), ("host_experts", "no"), ("host_expert_threads", -1),
              ("host_expert_threads", 1.5), ("copy_issue", "dma"), ("copy_issue", None),
              ("eviction", "fifo"), ("prefetch_victims", "none"), ("prefetch_victims", None),
              ("eviction", None), ("initial_chunk", 0), ("initial_chunk", True), ("prefetch_chunk", 0),
              ("early_read_fraction", math.nan), ("early_read_fraction", 1.5), ("early_read_fraction", -0.1),
              ("verify_wave", -2), ("verify_wave", 0.5), ("load_ahead_layers", -1), ("copy_streams", 3),
              ("copy_streams", True), ("copy_streams", 2.0), ("spare_rows", -1), ("spare_rows", 1.5),
              ("max_cache_len", 0)]


@pytest.mark.parametrize("name,value", BAD_VALUES)
def test_specter_config_refuses_bad_values(name, value):
    with pytest.raises(SpecterError) as err:
        SpecterConfig(**{name: value})
    message = str(err.value)
    assert name in message and "must be" in message and repr(value) in message and "\n" not in message


def test_specter_config_checks_every_field_and_stores_numbers_as_floats():
    assert {name for name, _ in BAD_VALUES} == {field.name for field in dataclasses.fields(SpecterConfig)}
    config = SpecterConfig(temperature=1, top_p=1, early_read_fraction=0)
    assert [type(v) for v in (config.temperature, config.top_p, config.early_read_fraction)] == [float] * 3
    assert SpecterConfig(k=1, resident_experts_per_layer=1, seed=-5, copy_streams=2, verify_wave=0,
                         load_ahead_layers=0, spare_rows=0, early_read_fraction=1, top_p=1e-9).k == 1
