"""scripts/fit_calibration.py's correction rounds: the build's offset from the simulation corrects the fit,
and the build closest to the real row is kept (a fake build and simulation, so no model is built)."""

import dataclasses

import numpy as np
import pytest
import torch

from experiments.datasets import data_dir
from experiments.locality import reference_curves
from specter.models.calibrated import RoutingProfile, simulated_routing
from specter.models.registry import get_spec
from tests.scripts import load_script

fit = load_script("fit_calibration")

TARGET = {("LRU", 0.5): 0.23, ("LRU", 1.0): 0.42, ("LRU", 2.0): 0.65, ("Belady", 1.0): 0.59}


def profile_simulating(curves: dict) -> RoutingProfile:
    """A stand-in profile whose simulated curves are `curves` (kept in its `target` field)."""
    return RoutingProfile(factors=((1.0, 2.0),), token_weight=1.0, accept_gain=1.0, embed_scale=12.0,
                          target=tuple(sorted(curves.items())))


@pytest.fixture
def builds(monkeypatch):
    """Fake builds: a build measures the simulated curves plus `offsets[i]` (i: the build's number); the
    simulated fit is exact. Returns the list of measured curves, its `offsets` set by the test."""
    measured_curves, offsets = [], []

    def probe_build(spec, layers, profile, per_dataset, seed, device, dtype):
        measured = {p: v + offsets[len(measured_curves)] for p, v in profile.target}
        measured_curves.append(measured)
        return "model", ["prompt"], [[1, 2, 3]], measured

    monkeypatch.setattr(fit, "probe_build", probe_build)
    monkeypatch.setattr(fit, "simulated_curves", lambda profile, *args: dict(profile.target))
    monkeypatch.setattr(fit, "fit_factors", lambda target, *args: profile_simulating(target))
    return measured_curves, offsets


def correct(rounds: int, step: float = 1.0):
    return fit.correct_by_builds(get_spec("phi"), 1, profile_simulating(TARGET), TARGET, rounds, 1, 0, "cpu", None,
                                 step)


@pytest.mark.parametrize("rounds, error", [(0, 0.05), (1, 0.0), (2, 0.0)])
def test_a_steady_offset_is_corrected_in_one_round(builds, rounds, error):
    builds[1].extend([0.05] * 3)
    profile, (_, _, _, curves) = correct(rounds)
    assert len(builds[0]) == rounds + 1
    assert max(abs(curves[p] - v) for p, v in TARGET.items()) == pytest.approx(error)
    if rounds:
        assert dict(profile.target) == pytest.approx({p: v - 0.05 for p, v in TARGET.items()})


def test_a_damped_step_moves_part_of_the_way(builds):
    builds[1].extend([0.05] * 3)
    profile, (_, _, _, curves) = correct(2, step=0.5)
    assert [max(abs(c[p] - v) for p, v in TARGET.items()) for c in builds[0]] == pytest.approx([0.05, 0.025, 0.0125])
    assert dict(profile.target) == pytest.approx({p: v - 0.0375 for p, v in TARGET.items()})


def test_the_build_closest_to_the_target_is_kept(builds):
    builds[1].extend([0.02, 0.09, 0.05, 0.02])  # the corrections overshoot: round 0's build stays the best
    profile, (_, _, _, curves) = correct(2)
    assert len(builds[0]) == 4  # round 0's build is built again at the end (one build alive at a time)
    assert dict(profile.target) == pytest.approx(TARGET)
    assert curves == pytest.approx({p: v + 0.02 for p, v in TARGET.items()})


def test_fit_loss_penalises_the_largest_error():
    even = {p: v + 0.02 for p, v in TARGET.items()}
    one_far = {p: v + (0.08 if p == ("LRU", 0.5) else 0.0) for p, v in TARGET.items()}  # same mean error
    assert fit.fit_loss(even, TARGET) == pytest.approx(0.02)
    assert fit.fit_loss(one_far, TARGET) > fit.fit_loss(even, TARGET) + 0.05


def test_given_factors_are_built_as_they_are_and_only_their_gain_is_fitted(monkeypatch):
    spec = get_spec("phi")
    real = {p: v for p, v in reference_curves("Phi-3.5-MoE").items() if p in fit.FIT_POINTS}
    built = []

    def probe_build(spec_, layers, profile, per_dataset, seed, device, dtype):
        built.append(profile)
        return type("Model", (), {"spec": spec_})(), ["prompt"], [list(range(64))], dict(real)

    monkeypatch.setattr(fit, "probe_build", probe_build)
    monkeypatch.setattr(fit, "fit_factors", lambda *a: pytest.fail("fitted factors that were given"))
    monkeypatch.setattr(fit, "rejection_ratios", lambda *a: np.linspace(0.0, 1.0, 101))
    monkeypatch.setattr(fit, "moe_layer_count", lambda config: 4)
    monkeypatch.setattr(fit, "lru_by_layer", lambda *a: [0.5])
    factors = ((5.0, 1.3), (2.0, float("inf")))
    result = fit.fit_model(spec.name, 1, 1, 0, 12.0, rounds=0, factors=factors)
    assert [p.factors for p in built] == [factors]  # one build, no correction rounds
    assert result["profile"].factors == factors and result["profile"].embed_scale == 12.0
    assert result["max_error"] == 0.0 and result["profile"].accept_gain > 0


def test_given_factors_start_the_corrections_when_rounds_are_asked(monkeypatch):
    real = {p: v for p, v in reference_curves("Phi-3.5-MoE").items() if p in fit.FIT_POINTS}
    far = {p: v - 0.1 for p, v in real.items()}
    built, refit = [], RoutingProfile(((0.9, 5.0), (0.5, float("inf"))), 1.0, 1.0, 12.0)

    def probe_build(spec_, layers, profile, per_dataset, seed, device, dtype):
        built.append(profile.factors)
        return type("Model", (), {"spec": spec_})(), ["prompt"], [list(range(64))], dict(far)

    monkeypatch.setattr(fit, "probe_build", probe_build)
    monkeypatch.setattr(fit, "simulated_curves", lambda *a: dict(real))
    monkeypatch.setattr(fit, "fit_factors", lambda *a: refit)
    monkeypatch.setattr(fit, "rejection_ratios", lambda *a: np.linspace(0.0, 1.0, 101))
    monkeypatch.setattr(fit, "moe_layer_count", lambda config: 4)
    monkeypatch.setattr(fit, "lru_by_layer", lambda *a: [0.5])
    factors = ((5.0, 1.3), (2.0, float("inf")))
    fit.fit_model("phi", 1, 1, 0, 12.0, rounds=1, factors=factors)
    assert built[:2] == [factors, refit.factors]  # the given factors first, then their correction


@pytest.mark.parametrize("argv, rounds", [(["--factors", "0.8:50"], 0), (["--factors", "0.8:50", "--rounds", "2"], 2),
                                          ([], 1)])
def test_rounds_default_to_zero_for_given_factors_and_one_for_a_fit(argv, rounds, monkeypatch):
    seen = []

    def fit_model(name, layers, per_dataset, seed, scale, device, dtype, direct, rounds_, step, factors,
                  clear_routing, token_pick, sim_sequences):
        seen.append(rounds_)
        return {"profile": None, "max_error": 0.0, "mean_error": 0.0, "min_distinct_per_64": 64, "measured": {}}

    monkeypatch.setattr(fit, "fit_model", fit_model)
    fit.main(["--models", "phi", *argv])
    assert seen == [rounds]


@pytest.mark.parametrize("argv, settings", [([], (False, 0.0, 8)), (["--clear-routing", "--token-pick", "0.06",
                                                                  "--sim-sequences", "48"], (True, 0.06, 48))])
def test_clear_routing_token_pick_and_simulation_size_reach_the_fit(argv, settings, monkeypatch):
    seen = []

    def fit_model(*args):
        seen.append(args[-3:])
        return {"profile": None, "max_error": 0.0, "mean_error": 0.0, "min_distinct_per_64": 64, "measured": {}}

    monkeypatch.setattr(fit, "fit_model", fit_model)
    fit.main(["--models", "phi", *argv])
    assert seen == [settings]


def test_every_build_of_a_fit_keeps_the_profiles_build_settings():
    """Corrections and refinements refit the factors only: cleared routing and the token pick stay."""
    start = RoutingProfile(((0.5, 3.0),), token_weight=1.0, accept_gain=2.0, embed_scale=12.0, clear_routing=True,
                           token_pick=0.06)
    kept = fit.built_like(RoutingProfile(((0.9, 9.0),), token_weight=1.0, accept_gain=0.0), start)
    assert kept.factors == ((0.9, 9.0),) and kept.accept_gain == 1.0
    assert (kept.embed_scale, kept.clear_routing, kept.token_pick) == (12.0, True, 0.06)


def test_the_simulation_with_a_token_pick_reuses_rank_two_more_than_rank_one():
    profile = RoutingProfile(((1.6, 60.0), (1.2, float("inf"))), token_weight=1.0, accept_gain=0.0)
    reuse = {}
    for pick in (0.0, 0.08):
        routing = simulated_routing(256, dataclasses.replace(profile, token_pick=pick), 16, 2, 1024, 1,
                                    torch.Generator().manual_seed(0))[0]  # [T][k]
        pairs = list(zip(routing, routing[1:]))
        reuse[pick] = [sum(now[r] in after for now, after in pairs) / len(pairs) for r in (0, 1)]
    assert reuse[0.0][0] > reuse[0.0][1] and reuse[0.08][1] > reuse[0.08][0], reuse


@pytest.mark.parametrize("text, pair", [("0.8:50", (0.8, 50.0)), ("2.098:inf", (2.098, float("inf")))])
def test_factor_arguments_parse(text, pair):
    assert fit.factor(text) == pair


def test_an_empty_simulation_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        fit.main(["--models", "phi", "--sim-sequences", "0"])
    assert exit_info.value.code == 2 and "--sim-sequences must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["0.8", "a:1", "0.8:0", "-1:5"])
def test_bad_factor_arguments_are_one_line_errors(text, capsys):
    with pytest.raises(SystemExit) as exit_:
        fit.main(["--models", "phi", f"--factors={text}"])
    assert exit_.value.code == 2 and "a factor" in capsys.readouterr().err


def test_refining_on_builds_builds_on_the_given_device_and_dtype_and_moves_toward_the_target(monkeypatch):
    """Each evaluation is a build on the device and in the dtype asked (a real-depth refine runs on a GPU);
    the fake build's curves rise with the fast factor's weight, so the refined weight moves toward the target."""
    real = {p: v for p, v in reference_curves("Phi-3.5-MoE").items() if p in fit.FIT_POINTS}
    places = []

    def probe_build(spec_, layers, profile, per_dataset, seed, device, dtype):
        places.append((device, dtype))
        fast = profile.factors[0][0]
        return None, None, None, {p: v + 0.1 * (fast - 2.0) for p, v in real.items()}  # exact at fast = 2

    monkeypatch.setattr(fit, "probe_build", probe_build)
    start = RoutingProfile(((1.0, 6.0), (0.8, 50.0), (0.6, float("inf"))), 1.0, 1.0, 12.0)
    refined = fit.refine_on_build(get_spec("phi"), None, start, real, 1, 0, 40, "meta", torch.float16)
    assert set(places) == {("meta", torch.float16)} and len(places) <= 40
    assert abs(refined.factors[0][0] - 2.0) < abs(start.factors[0][0] - 2.0)
    assert refined.embed_scale == 12.0 and len(refined.factors) == 3


def test_lru_by_layer_gives_each_moe_layer_and_averages_to_the_overall_curve():
    """Per-layer LRU@1 of a tiny calibrated build's committed routing: one value per MoE layer, whose mean is
    the all-layer curve that the fit reports (every layer sees the same tokens)."""
    if not (data_dir() / "gsm8k" / "test.jsonl").is_file():
        pytest.skip(f"the local datasets are not at {data_dir()} (set SPECTER_DATA to the shared data directory)")
    spec = get_spec("tiny-mixtral")
    model, prompts, walks, curves = fit.probe_build(spec, None, spec.routing_profile, 1, 0, "cpu", torch.float32)
    by_layer = fit.lru_by_layer(model, prompts, walks)
    assert len(by_layer) == model.num_moe_layers >= 2 and all(0.0 <= v <= 1.0 for v in by_layer)
    assert np.mean(by_layer) == pytest.approx(curves[("LRU", 1.0)], abs=2e-3)


@pytest.mark.slow
def test_the_check_measures_a_gptq_draft_calibrated_on_prompts_it_does_not_decode(monkeypatch):
    if not (data_dir() / "gsm8k" / "test.jsonl").is_file():
        pytest.skip(f"the local datasets are not at {data_dir()} (set SPECTER_DATA to the shared data directory)")
    spec = get_spec("tiny-mixtral")
    calibrated_on, real_quantize = [], fit.quantize_experts_gptq

    def quantize(model, ids, **options):
        calibrated_on.extend(ids)
        return real_quantize(model, ids, **options)

    monkeypatch.setattr(fit, "quantize_experts_gptq", quantize)
    check = fit.check_in(torch.float32, spec, spec.routing_profile, 1, 0, "cpu", gptq=True, layers=2)
    assert check["token_agreement"] == check["gptq_token_agreement"] == 1.0
    assert 0.9 <= check["acceptance"] <= 1.0 and 0.9 <= check["gptq_acceptance"] <= 1.0, check
    two_each = fit.local_prompts(fit.ByteTokenizer(spec.hf_config["vocab_size"]), 2)  # [gsm8k 0, 1, wikitext2 0, ...]
    assert [ids[:, :16].tolist() for ids in calibrated_on] == [p.tolist() for p in two_each[1::2]]  # the 2nd ones
    assert all(ids.shape[1] == 16 + 128 for ids in calibrated_on)  # with their walks
