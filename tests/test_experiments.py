"""The paper's experiments on the tiny model: protocol rows, depth/prefix/routing/kernel, resume, figures, run_all."""
import json
import os
import subprocess
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from experiments.figures import main as figures_main
from experiments.main import run as run_experiment
from experiments.settings import earlier_invocations
from tests.cli import cli_error

ROOT = Path(__file__).resolve().parent.parent
FAST = ("num_prompts=2", "repeats=2", "max_new_tokens=10", "device=cpu")


def run_in_process(*overrides: str) -> Path:
    """`python -m experiments.main OVERRIDES` without a new interpreter (no import time); returns its directory."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return run_experiment(compose(config_name="config", overrides=list(overrides)))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    """One tiny run of each experiment into <root>/<experiment>/tiny-dsv2-high, in this process (the
    command line itself is run by run_all below and by tests/test_main.py)."""
    root = tmp_path_factory.mktemp("results")
    for experiment, extra in (("depth", ("++experiment.k_values=[2,4]",)), ("main", ("k=auto",)),
                              ("prefix", ("++experiment.prefix_values=[4,8]",)), ("routing", ()), ("kernel", ()),
                              ("batch", ("experiment.batch_sizes=[1,2]",))):
        run_in_process(f"experiment={experiment}", *FAST, *extra, f"results_root={root}",
                       f"results_dir={root / experiment / 'tiny-dsv2-high'}")
    return root


def test_main_protocol_rows(results):
    records = pd.read_csv(results / "main" / "tiny-dsv2-high" / "records.csv")
    assert len(records) == 2 * 2 * 3  # prompts x repeats x systems
    assert set(records.repeat) == {0, 1} and (records.dataset == "builtin").all()
    assert set(records.k) == {json.loads((results / "depth" / "tiny-dsv2-high" / "best_k.json").read_text())["best_k"]}
    summary = pd.read_csv(results / "main" / "tiny-dsv2-high" / "summary.csv")
    assert {"builtin", "AVG"} <= set(summary.dataset) and "tpot_over_specter" in summary
    run = json.loads((results / "main" / "tiny-dsv2-high" / "run.json").read_text())
    assert run["complete"] and run["config"]["experiment"]["name"] == "main" and "torch" in run["versions"]
    assert run["machine"]["cpu_cores"] >= 1 and run["machine"]["load_average_1min"] >= 0  # what the timings ran under


def test_depth_prefix_routing_kernel_outputs(results):
    depth = pd.read_csv(results / "depth" / "tiny-dsv2-high" / "records.csv")
    assert set(depth.k) == {2, 4} and set(depth.system) == {"specter"}
    prefix = pd.read_csv(results / "prefix" / "tiny-dsv2-high" / "records.csv")
    assert set(prefix.prefix_tokens) == {4, 8}
    sets = pd.read_csv(results / "routing" / "tiny-dsv2-high" / "routing_working_sets.csv")
    assert (sets.working_set >= 1).all() and len(sets) > 0
    locality = pd.read_csv(results / "routing" / "tiny-dsv2-high" / "routing_locality.csv")
    assert set(locality.metric) == {"LRU", "LFU", "Belady", "SCH16", "draft_topk_recall"}
    assert locality.measured.between(0, 1).all() and locality.real.isna().all()  # no real row for tiny-dsv2
    assert (results / "routing" / "tiny-dsv2-high" / "routing_locality.png").stat().st_size > 0
    kernel = pd.read_csv(results / "kernel" / "tiny-dsv2-high" / "records.csv")
    assert kernel.status.str.startswith("unavailable: ").all()  # no CUDA: a reason, never a number


def test_batch_rows_per_system_and_batch_size(results):
    records = pd.read_csv(results / "batch" / "tiny-dsv2-high" / "records.csv")
    ok = records[records.status == "ok"]
    assert set(ok.system) == {"specter", "target_only", "mo_sm", "specmoeoff_sm", "transformers"}
    assert set(ok.batch_size) == {1, 2} and len(ok) == 5 * 2 * 2  # systems x batch sizes x repeats
    assert (ok[ok.system != "target_only"].tokens_match_target == "yes").all()  # every request, every batch
    assert (ok.throughput_tok_s > 0).all() and (ok[ok.system == "specter"].working_set_mean >= 1).all()


def test_figures_render_from_the_files(results):
    assert figures_main([str(results)]) == 0
    assert "| specter | builtin | 2 |" in (results / "figures" / "table3_batch.md").read_text()
    for stem in ("fig7_depth", "fig13_routing", "routing_locality", "fig14_main", "fig15_batch", "fig16_working_set"):
        for ext in ("png", "pdf", "csv"):
            assert (results / "figures" / f"{stem}.{ext}").stat().st_size > 0
    assert figures_main([str(results / "nothing-here")]) == 2


def test_figure15_draws_tpot_and_throughput_on_log_axes(results, tmp_path, monkeypatch):
    from experiments import figures
    axes, save = [], figures._save
    monkeypatch.setattr(figures, "_save", lambda fig, *args: axes.extend(fig.axes) or save(fig, *args))
    assert figures.figure15_batch(results, tmp_path)
    left, right = axes
    assert left.get_yscale() == right.get_yscale() == "log"
    assert left.get_ylabel() == "TPOT (ms, median, log scale)" and "log scale" in right.get_ylabel()


def test_figure14_tells_the_two_specters_apart(results, tmp_path, monkeypatch):
    import matplotlib.figure

    from experiments.figures import figure14_main
    labels = []
    legend = matplotlib.figure.Figure.legend
    monkeypatch.setattr(matplotlib.figure.Figure, "legend",
                        lambda fig, handles, names, **kw: labels.extend(names) or legend(fig, handles, names, **kw))
    figure14_main(results, tmp_path)
    assert {"Specter (default)", "Specter (paper's design)", "target_only"} <= set(labels)


def test_figure14_panels_have_avg_only_over_several_datasets():
    from experiments.figures import main_panel
    one = pd.DataFrame({"dataset": ["gsm8k", "AVG"] * 2, "system": ["specter"] * 2 + ["mo_sm"] * 2,
                        "tpot_ms": [10.0, 10.0, 40.0, 40.0]})
    assert list(main_panel(one).index) == ["gsm8k"]
    two = pd.DataFrame({"dataset": ["gsm8k", "humaneval", "AVG"], "system": ["specter"] * 3,
                        "tpot_ms": [10.0, 20.0, 15.0]})
    assert list(main_panel(two).index) == ["gsm8k", "humaneval", "AVG"]


def test_calibrated_routing_run_names_its_workload_and_compares_with_the_real_row(tmp_path, capsys):
    run_in_process("experiment=routing", "model=tiny-mixtral", "model.weights=calibrated", "model.layers=2",
                   "num_prompts=1", "max_new_tokens=24", "device=cpu", f"results_dir={tmp_path / 'r'}")
    assert "tiny-mixtral (calibrated weights, 2 layers)" in capsys.readouterr().out
    run = json.loads((tmp_path / "r" / "run.json").read_text())
    assert run["workload"] == "tiny-mixtral: calibrated weights (real routing locality and acceptance), 2 layers"
    locality = pd.read_csv(tmp_path / "r" / "routing_locality.csv")
    lru = locality[(locality.metric == "LRU") & (locality.rho == 1.0)].iloc[0]
    assert lru.real == 0.37 and 0 < lru.measured <= 1  # Mixtral's row


def test_weights_and_layers_errors_are_one_line(tmp_path, monkeypatch):
    for args, message in ((("model=tiny-qwen", "model.weights=calibrated"), "no calibrated routing profile"),
                          (("model=dsv2", "model.layers=3"), "needs model.weights=synthetic or calibrated"),
                          (("model=dsv2", "model.weights=calibrated", "model.layers=1"), "integer above 1"),
                          (("model=tiny", "model.weights=random"), "model.weights must be one of")):
        error = cli_error(tmp_path, monkeypatch, *args, f"results_dir={tmp_path / 'x'}")
        assert message in error and "\n" not in error, (args, error)
        assert not (tmp_path / "x").exists()


def test_specter_options_and_ablations_reach_the_run(tmp_path):
    """specter.* overrides reach the run (run.json records them); an ablation's own field still applies."""
    out = tmp_path / "run"
    run_in_process(*FAST, "num_prompts=1", "repeats=1", "warmup_tokens=2", "mem.slots=2",
                   "systems=[specter,specter_no_prefetch]", "specter.top_p=0.9", "specter.eviction=lookahead",
                   "specter.pooled_slots=1", "temperature=0.7", "seed=3", f"results_dir={out}")
    records = pd.read_csv(out / "records.csv")
    loads = records[records.status == "ok"].groupby("system").prefetch_loads.sum()
    assert loads["specter_no_prefetch"] == 0 and loads["specter"] > 0
    run = json.loads((out / "run.json").read_text())["config"]
    assert run["specter"]["top_p"] == 0.9 and run["specter"]["eviction"] == "lookahead"
    assert run["specter"]["pooled_slots"] == 1 and (run["temperature"], run["seed"]) == (0.7, 3)


def test_resume_skips_finished_cases(tmp_path):
    out = tmp_path / "run"
    run_in_process(*FAST, f"results_dir={out}")
    before = pd.read_csv(out / "records.csv")
    first = json.loads((out / "run.json").read_text())["invocations"]
    assert [call["first_row"] for call in first] == [0] and first[0]["machine"]["host_op_us"] > 0
    info = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({**info, "complete": False}))  # as if cut before its last case
    lines = (out / "records.csv").read_text().splitlines(keepends=True)
    (out / "records.csv").write_text("".join(lines[:-1]))
    run_in_process(*FAST, f"results_dir={out}", "resume=true")
    after = pd.read_csv(out / "records.csv")
    assert len(after) == len(before) and after.iloc[-1].system == before.iloc[-1].system  # only the cut case ran
    calls = json.loads((out / "run.json").read_text())["invocations"]
    assert calls[0] == first[0] and calls[1]["first_row"] == len(before) - 1  # each process that resumed it, in order
    assert calls[1]["started_utc"] >= calls[0]["started_utc"]


def test_earlier_invocations_of_a_run_json_from_before_the_list(tmp_path):
    assert earlier_invocations(tmp_path) == []  # no run.json
    (tmp_path / "run.json").write_text(json.dumps({"git_commit": "abc", "gpu": "H200", "machine": {"host_op_us": 4.7}}))
    assert earlier_invocations(tmp_path) == [{"started_utc": None, "git_commit": "abc", "gpu": "H200",
                                              "machine": {"host_op_us": 4.7}, "first_row": None}]
    (tmp_path / "run.json").write_text("{")  # torn: nothing to keep
    assert earlier_invocations(tmp_path) == []


def test_unavailable_dataset_is_a_row_not_a_crash(tmp_path, monkeypatch):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):  # as run_all.sh --tiny: local files only
        monkeypatch.setenv(name, "1")
    out = tmp_path / "run"
    run_in_process(*FAST, "dataset=all", f"results_dir={out}", "num_prompts=1", "repeats=1")
    records = pd.read_csv(out / "records.csv")
    assert records.status.str.startswith("unavailable: ").any()  # gpqa/c4 have no file here and no network


def test_run_all_dry_run_and_tiny(tmp_path):
    dry = subprocess.run(["bash", "scripts/run_all.sh", "--tiny", "--dry-run", "--results", str(tmp_path), "--",
                          "max_new_tokens=8"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0 and "about" in dry.stdout and "[todo] experiment=depth" in dry.stdout
    assert dry.stdout.count(" max_new_tokens=8 -> ") == dry.stdout.count("[todo]") > 0  # overrides reach every step
    assert not any(tmp_path.iterdir())  # a dry run writes nothing
    bad = subprocess.run(["bash", "scripts/run_all.sh", "--bogus"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("error:")
    default = subprocess.run(["bash", "scripts/run_all.sh", "--tiny", "--dry-run"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
    assert "into results/paper/" in default.stdout  # its own root: the quick start's results/main is not reused
    assert "-> results/paper/main/tiny-dsv2-high" in default.stdout


@pytest.mark.slow
def test_run_all_tiny_end_to_end_and_resumable(tmp_path):
    """The whole plan on one model (`--models`) and its figures. vLLM is pointed at a missing environment
    here (its rows say so): its worker takes half a minute per main step on the CPU, and
    tests/test_baseline_vllm.py runs it. Overrides after `--` shorten every step (one built-in prompt, 8 tokens)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECTER_VLLM_VENV": str(tmp_path / "no-vllm-venv")}
    cmd = ["bash", "scripts/run_all.sh", "--tiny", "--models", "tiny-dsv2", "--results", str(tmp_path), "--",
           "max_new_tokens=8", "dataset=builtin"]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    for stem in ("fig14_main", "fig15_batch", "fig16_working_set"):
        assert (tmp_path / "figures" / f"{stem}.png").exists(), stem
    run = json.loads((tmp_path / "main" / "tiny-dsv2-low" / "run.json").read_text())
    assert run["complete"] and run["config"]["max_new_tokens"] == 8
    main_rows = pd.read_csv(tmp_path / "main" / "tiny-dsv2-low" / "records.csv")
    assert main_rows[main_rows.system == "vllm"].status.str.startswith("unavailable: vLLM environment not found").any()
    second = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert second.returncode == 0 and second.stdout.count("skip (done)") == 7
