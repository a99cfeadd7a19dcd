"""The `specter` config group and SpecterConfig: every option reaches the run, ablations are overrides of the
group, bad values are one-line errors."""
import dataclasses
import math

import pytest
from omegaconf import OmegaConf

from experiments import systems as systems_module
from experiments.settings import DERIVED, model_choice, specter_config, specter_fields
from experiments.systems import build_system, known_systems
from specter.config import PAPER_DESIGN, SpecterConfig
from specter.mechanisms import resolve
from specter.errors import SpecterError
from tests.cli import compose_with
from tests.conftest import tiny_model

NON_DEFAULT = {"top_p": 0.9, "prefetch": False, "expert_wise": False, "eviction": "lookahead", "cuda_graph": False,
               "draft_compile": False, "draft_ahead": False, "residual_transfer": False, "pooled_slots": 1,
               "coded_slots": False}
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
    paper = system != "specter"  # specter_paper and the paper's ablations of its design
    assert set(raw) <= {"_target_", "design", "specter"} and raw._target_ == "experiments.systems.make_specter"
    assert raw.get("design") == ("paper" if paper else None)
    block = dict(raw.get("specter") or {})
    assert set(block) <= set(specter_fields()) and (system in ("specter", "specter_paper")) == (not block)
    cfg = compose_with("specter.top_p=0.9", "specter.eviction=popularity", "mem.slots=3")
    model = tiny_model("tiny")
    run = specter_config(cfg, model.spec)
    built = build_system(system, model, run)
    asked = SpecterConfig.paper(**{**dataclasses.asdict(run), **block, **PAPER_DESIGN}) if paper else \
        dataclasses.replace(run, **block)
    assert built.config == resolve(asked, model).config
    assert built.config.top_p == 0.9 and built.config.eviction == "popularity"
    assert (built.config.residual_transfer, built.config.draft_ahead) == (False, False)  # float32 on a CPU: both off
    assert asked.draft_ahead == (not paper)  # asked for by the default, switched off here


@pytest.mark.parametrize("override,message", [
    ("+specter.temperature=0.5", "specter.temperature is not a Specter option here: it comes from the top-level"),
    ("+specter.k=2", "specter.k is not a Specter option here: it comes from the top-level k="),
    ("+specter.resident_experts_per_layer=2", "it comes from mem="),
    ("+specter.topp=0.9", "unknown Specter option specter.topp; known: top_p, prefetch,"),
    ("specter.top_p=0", "top_p must be a number in (0, 1], got 0"),
    ("specter.top_p=1.5", "top_p must be a number in (0, 1], got 1.5"),
    ("specter.eviction=fifo", "eviction must be 'lru', 'lookahead' or 'popularity', got 'fifo'"),
    ("specter.pooled_slots=-1", "pooled_slots must be an integer >= 0, got -1"),
    ("specter.pooled_slots=1.5", "pooled_slots must be an integer >= 0, got 1.5"),
    ("specter.prefetch=1", "prefetch must be true or false, got 1"),
    ("+specter.spare_rows=8", "unknown Specter option specter.spare_rows"),
    ("k=2.5", "k must be an integer >= 1 or None, got 2.5"),
    ("k=true", "k must be an integer >= 1 or None, got True"),
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
                                 ("c", "pooled_slots: -2", "pooled_slots must be an integer >= 0, got -2")):
        (tmp_path / f"{name}.yaml").write_text(f"_target_: experiments.systems.make_specter\nspecter:\n  {block}\n")
        with pytest.raises(SpecterError, match=message):
            build_system(name, model, config)


BAD_VALUES = [("k", True), ("k", 2.5), ("k", "4"), ("k", 0), ("resident_experts_per_layer", True),
              ("resident_experts_per_layer", 0), ("temperature", math.nan), ("temperature", math.inf),
              ("temperature", -1), ("temperature", "0"), ("temperature", True), ("top_p", 0), ("top_p", 1.5),
              ("top_p", math.nan), ("top_p", True), ("seed", 1.5), ("seed", True), ("seed", "0"), ("prefetch", 1),
              ("prefetch", "false"), ("expert_wise", None), ("cuda_graph", "yes"), ("draft_compile", 1),
              ("draft_ahead", "yes"), ("residual_transfer", 1), ("pooled_slots", -1), ("pooled_slots", 1.5),
              ("pooled_slots", True), ("coded_slots", 1), ("coded_slots", "yes"), ("eviction", "fifo"), ("eviction", None)]


@pytest.mark.parametrize("name,value", BAD_VALUES)
def test_specter_config_refuses_bad_values(name, value):
    with pytest.raises(SpecterError) as err:
        SpecterConfig(**{name: value})
    message = str(err.value)
    assert name in message and "must be" in message and repr(value) in message and "\n" not in message


def test_specter_config_checks_every_field_and_stores_numbers_as_floats():
    assert {name for name, _ in BAD_VALUES} == {field.name for field in dataclasses.fields(SpecterConfig)}
    config = SpecterConfig(temperature=1, top_p=1)
    assert [type(v) for v in (config.temperature, config.top_p)] == [float] * 2
    assert SpecterConfig(k=1, resident_experts_per_layer=1, seed=-5, pooled_slots=0, top_p=1e-9).k == 1


def test_the_default_is_the_fastest_configuration_and_paper_is_the_papers_design():
    default, paper = SpecterConfig(), SpecterConfig.paper()
    assert len(dataclasses.fields(SpecterConfig)) <= 15
    assert (default.residual_transfer, default.draft_ahead, default.draft_compile, default.pooled_slots) == \
        (True, True, True, 2)
    assert (paper.residual_transfer, paper.draft_ahead, paper.draft_compile, paper.pooled_slots) == \
        (False, False, False, 0)
    assert dataclasses.replace(paper, **{name: getattr(default, name) for name in PAPER_DESIGN}) == default
    assert SpecterConfig.paper(k=8, eviction="popularity").k == 8 and SpecterConfig.paper(draft_ahead=True).draft_ahead


def test_the_main_experiment_compares_the_default_with_the_papers_design():
    assert list(compose_with().systems) == ["specter", "specter_paper", "target_only"]
    assert len(known_systems()) <= 14


def test_every_config_default_named_in_the_source_is_a_specter_config_field():
    """Modules that read one SpecterConfig default by name (config_default("...")) name a field that exists: a
    removed field fails here rather than on the first CUDA decode that reads it."""
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    named = {(path.relative_to(root).as_posix(), name)
             for folder in ("specter", "baselines", "experiments", "benchmarks")
             for path in (root / folder).rglob("*.py")
             for name in re.findall(r'config_default\(\s*"([a-z_0-9]+)"', path.read_text())}
    assert len(named) >= 5  # the scan finds the readers
    missing = sorted((path, name) for path, name in named if name not in SpecterConfig.__dataclass_fields__)
    assert not missing, missing


def test_a_system_file_that_builds_no_system_is_one_line(tmp_path, monkeypatch):
    """The harness checks what a system file builds against baselines.base.System."""
    monkeypatch.setattr(systems_module, "SYSTEM_CONF", tmp_path)
    (tmp_path / "odd.yaml").write_text("_target_: builtins.dict\n")
    with pytest.raises(SpecterError, match="conf/system/odd.yaml builds a dict, which lacks the System contract"):
        build_system("odd", tiny_model("tiny"), SpecterConfig(resident_experts_per_layer=2))
