"""benchmarks/bench_offload.py's summary of runs (on CPU stats: the script itself needs a GPU)."""
import dataclasses
import re
import sys
from types import SimpleNamespace

import pytest
import torch

import specter
from baselines.target_only import TargetOnly
from tests.conftest import prompt
from tests.scripts import load_script

bench = load_script("bench_offload")


def test_summary_rows_line_and_table(capsys):
    model = specter.load_model("tiny-qwen", device="cpu", dtype=torch.float32)
    prompts = [prompt(), prompt("def f(x):")]
    reference = [r["tokens"] for r in bench.run(TargetOnly(model), prompts, 12)]
    engine = specter.SpecterEngine(model, specter.SpecterConfig(k=3, resident_experts_per_layer=2))
    runs = bench.run(engine, prompts, 12)
    assert bench.summarize("specter", runs, reference)["io_floor_ms"] != bench.summarize(
        "specter", runs, reference)["io_floor_ms"]  # no bandwidth (no GPU): no floor, NaN
    row = bench.summarize("specter", runs, reference, h2d_gbps=50.0)  # the run's one bandwidth
    decode = sum(r["decode_h2d_bytes"] for r in runs) / sum(r["generated_tokens"] - 1 for r in runs)
    assert row["decode_h2d_mb_per_token"] == pytest.approx(decode / 1e6) and row["prefill_h2d_mb"] > 0
    assert row["tokens_match_resident"] == 1.0 and row["io_floor_ms"] == pytest.approx(decode / 50e6)
    assert row["bytes_over_window_misses"] >= 1
    assert all(row[f"copy_idle_{p}_ms_per_token"] >= 0 for p in ("draft", "verify", "between"))
    assert "TPOT / I/O floor" in bench.row_line(row) and "copy idle ms/token" in bench.row_line(row)
    assert "host ms/token in MoE layers" in bench.row_line(row) and "(loads " in bench.row_line(row)
    assert row["verify_waves_per_token"] > 0 and f"{row['verify_waves_per_token']:.1f}/token); decode" in bench.row_line(row)
    assert row["residual_group_host_ms_per_token"] == 0 == row["upload_wait_ms_per_token"]  # CPU: no groups, rings
    assert "decode launches 0.0/token, group launches' host ms 0.00, upload ring waits 0.00; stream waits spared " \
        "0.0/token" in bench.row_line(row)  # CPU: no stream waits at all
    assert row["h2d_copy_calls_per_token"] == row["h2d_copies_per_token"] > 0  # CPU: every load its own copy
    assert f"copy calls {row['h2d_copies_per_token']:.1f}/token for {row['h2d_copies_per_token']:.1f} loads" \
        in bench.row_line(row)
    bench.print_table([dict(row, k=3)])  # no target-only or eager rows: the ratios they anchor are left out
    out = capsys.readouterr().out
    assert "specter: TPOT / I/O floor" in out and "draft step" not in out


def test_repeats_decode_every_prompt_again_and_keep_the_spread():
    model = specter.load_model("tiny", device="cpu", dtype=torch.float32)
    prompts = [prompt(), prompt("def f(x):")]
    reference = [r["tokens"] for r in bench.run(TargetOnly(model), prompts, 8)]
    engine = specter.SpecterEngine(model, specter.SpecterConfig(k=3, resident_experts_per_layer=2))
    runs = bench.run(engine, prompts, 8, repeats=2)
    assert [r["tokens"] for r in runs] == reference * 2
    row = bench.summarize("specter", runs, reference)
    assert row["tokens_match_resident"] == 1.0
    assert row["tpot_min_ms"] <= row["tpot_ms"] <= row["tpot_max_ms"]
    assert f"({row['tpot_min_ms']:.2f}-{row['tpot_max_ms']:.2f})" in bench.row_line(row)
    wrong = dict(runs[1], tokens=runs[0]["tokens"])  # prompt 1's decode with prompt 0's tokens
    assert bench.summarize("specter", [runs[0], wrong], reference)["tokens_match_resident"] == 0.5


def test_host_profile_lists_functions_and_the_callers_of_host_waits(tmp_path, capsys):
    model = specter.load_model("tiny", device="cpu", dtype=torch.float32)
    engine = specter.SpecterEngine(model, specter.SpecterConfig(k=3, resident_experts_per_layer=2))
    bench.host_profile(engine, prompt(), 6, tmp_path / "profile.txt")
    text = (tmp_path / "profile.txt").read_text()
    assert "tottime" in text and "was called by" in text  # the callers section, empty of waits on a CPU
    assert "ncalls" in capsys.readouterr().out


def test_bench_offload_rejects_zero_repeats_and_a_system_twice(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_offload.py", "--repeats", "0"])
    with pytest.raises(SystemExit, match="--repeats must be at least 1, got 0"):
        bench.main()
    for variants in (["paper"], ["prefetch=false", "prefetch=false"]):
        with pytest.raises(SystemExit, match="--variants repeats a system"):
            bench.main(["--variants", *variants])


def load_simulation():
    return load_script("sim_offload_bytes")


def test_byte_simulation_counts_on_a_tiny_model():
    sim = load_simulation()
    model = specter.load_model("tiny", device="cpu", dtype=torch.float32)
    config = specter.SpecterConfig(k=4, resident_experts_per_layer=2, cuda_graph=False)
    row = sim.measure(model, config, [prompt(), prompt("def f(x):")], 16)
    assert row["bytes_over_window_misses"] >= 1
    assert row["decode_loads_per_token"] >= row["window_miss_loads_per_token"] > 0
    assert row["pcie_mb_per_token"] > 0 and "host_runs_per_token" not in row
    mo_sm = sim.measure_mo_sm(model, 1, [prompt()], 8)
    assert mo_sm["slots"] >= 1 and mo_sm["pcie_mb_per_token"] > 0
    extra = sum(row[f"reload_{cause}_per_token"] for cause in ("prefetch", "ahead", "verify"))
    excess = row["decode_loads_per_token"] - row["window_miss_loads_per_token"]
    # each reload and each load of an expert the target did not route is over the floor (one load can be both)
    assert extra <= excess + 1e-9 and row["wasted_per_token"] <= excess + 1e-9


@pytest.mark.parametrize("argv, message", [
    (["--model", "qwen", "--moe-layers", "25"], "1..24 (qwen has 24 MoE layers)"),
    (["--moe-layers", "0"], "1..26 (dsv2 has 26 MoE layers)"),
    (["--weights", "calibrated", "--k", "0"], "--k and --slots must be at least 1"),
])
def test_byte_simulation_rejects_bad_arguments_before_building(monkeypatch, argv, message):
    sim = load_simulation()
    monkeypatch.setattr(sys, "argv", ["sim_offload_bytes.py", *argv])
    monkeypatch.setattr(sim, "build", lambda *a, **k: pytest.fail("built a model for bad arguments"))
    with pytest.raises(SystemExit, match=re.escape(message)):
        sim.main()


def test_variants_parse_numbers_and_names_and_start_from_the_paper_design():
    assert bench.parse_variant("top_p=0.5,pooled_slots=0,eviction=popularity") == {
        "top_p": 0.5, "pooled_slots": 0, "eviction": "popularity"}
    assert specter.SpecterConfig(**bench.parse_variant("prefetch=false,cuda_graph=True")).prefetch is False
    paper = specter.SpecterConfig(**bench.parse_variant("paper,prefetch=false"))
    assert paper == bench.paper_config(prefetch=False) and not paper.residual_transfer and paper.pooled_slots == 0
    with pytest.raises(SystemExit, match="takes \\[paper,\\]key=value"):
        bench.parse_variant("prefetch")


class _Recorder:
    """A system that records its generate() calls and returns fixed stats and tokens."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def generate(self, ids, new_tokens):
        self.calls.append((self.name, int(ids[0, 0]), new_tokens))
        return type("Result", (), {"stats": {"tpot_ms": 1.0}, "token_ids": [self.name]})()


def test_interleaved_runs_warm_every_system_then_take_turns_round_by_round():
    calls = []
    systems = [("a", _Recorder("a", calls)), ("b", _Recorder("b", calls))]
    prompts = [torch.tensor([[7]]), torch.tensor([[9]])]
    runs = bench.run_interleaved(systems, prompts, 50, repeats=2)
    warm = [("a", 7, bench.WARMUP_TOKENS), ("b", 7, bench.WARMUP_TOKENS)]
    round_ = [("a", 7, 50), ("a", 9, 50), ("b", 7, 50), ("b", 9, 50)]
    assert calls == warm + round_ + round_
    assert {label: len(r) for label, r in runs.items()} == {"a": 4, "b": 4}
    assert all(r["tokens"] == ["b"] for r in runs["b"])


def test_measure_interleaved_gives_each_variant_its_ratio_to_specter(capsys):
    model = specter.load_model("tiny", device="cpu", dtype=torch.float32)
    prompts = [prompt(), prompt("def f(x):")]
    reference = [r["tokens"] for r in bench.run(TargetOnly(model), prompts, 8)]
    options = bench.BenchOptions(new_tokens=8, quick=True, variants=("prefetch=false",), repeats=2, interleave=True)
    systems, compare = bench.build_systems(model, 2, [3], options)
    assert [label for label, _ in systems] == ["specter_paper", "specter", "specter_prefetch=false"]
    assert compare == {"specter": ("specter_paper", "tpot_over_paper"),
                       "specter_prefetch=false": ("specter", "tpot_over_specter")}
    written = []
    rows = bench.measure(systems, compare, prompts, reference, options, lambda row: written.append(row) or row)
    paper, specter_row, variant = rows
    assert written == rows and paper["tpot_over_paper"] is None is paper["tpot_over_specter"]
    assert specter_row["tpot_over_paper"] == pytest.approx(specter_row["tpot_ms"] / paper["tpot_ms"])
    assert specter_row["tpot_over_specter"] is None and variant["tokens_match_resident"] == 1.0
    assert variant["tpot_over_specter"] == pytest.approx(variant["tpot_ms"] / specter_row["tpot_ms"])
    out = capsys.readouterr().out
    assert "interleaved" in out and f"{variant['tpot_over_specter']:.3f}x specter's TPOT" in out
    assert f"{specter_row['tpot_over_paper']:.3f}x specter_paper's TPOT" in out
    bench.print_table([dict(row, k=3) for row in rows])
    out = capsys.readouterr().out
    assert f"{variant['tpot_over_specter']:.3f}x Specter's TPOT" in out
    assert f"specter: {specter_row['tpot_over_paper']:.3f}x the paper design's TPOT" in out


def test_the_paper_system_is_the_paper_design_and_specter_the_defaults(monkeypatch):
    """The configs asked for (an engine's own config is what ran: on a CPU the CUDA mechanisms are off)."""
    monkeypatch.setattr(bench.specter, "SpecterEngine", lambda model, config: SimpleNamespace(config=config))
    monkeypatch.setattr(bench, "TargetOnly", lambda model, slots: SimpleNamespace(slots=slots))
    options = bench.BenchOptions(variants=("paper,prefetch=false",))
    systems = bench.build_systems("a model", 2, [3, 8], options)[0]
    assert [label for label, _ in systems] == ["target_only_offload"] + [
        f"specter{name}_k{k}" for k in (3, 8) for name in ("_paper", "", "_paper,prefetch=false")]
    _, (_, paper), (_, default), (_, ablation) = systems[:4]
    assert default.config == specter.SpecterConfig(k=3, resident_experts_per_layer=2)
    assert paper.config == specter.SpecterConfig(k=3, resident_experts_per_layer=2, **bench.PAPER)
    assert ablation.config == dataclasses.replace(paper.config, prefetch=False)
    mechanisms = bench.mechanisms_text({"prefetch": "on", "draft_ahead": "off: no CUDA"})
    assert mechanisms == "prefetch=on; draft_ahead=off: no CUDA" and bench.mechanisms_text(None) is None


def test_default_k_is_the_depth_profile_where_the_model_has_one():
    from specter.models.registry import get_spec
    assert bench.default_k(get_spec("dsv2"), "low") == 32 and bench.default_k(get_spec("dsv2"), "high") == 16
    assert bench.default_k(get_spec("qwen"), "high") == 16 and bench.default_k(get_spec("tiny"), "low") == 4


def test_residual_what_if_prices_loads_at_a_blob_and_holds_more_slots_in_the_same_memory():
    from specter.offload.runtime import offload_experts

    sim = load_simulation()
    model = specter.load_model("tiny", device="cpu", dtype=torch.float16)
    offload_experts(model, 3)
    config = specter.SpecterConfig(k=4, resident_experts_per_layer=3, cuda_graph=False)
    sixteen, residual, coded = sim.residual_rows(model, config, [prompt()], 8)
    ratio = sixteen["blob_over_raw"]
    assert 0 < ratio < 1 and residual["pcie_mb_per_token"] == pytest.approx(sixteen["pcie_mb_per_token"] * ratio)
    assert coded["slots"] == min(model.num_experts, int(3 // ratio)) > 3  # more experts in the same bytes
    assert coded["hit_rate"] >= sixteen["hit_rate"] and coded["pcie_mb_per_token"] <= residual["pcie_mb_per_token"]
