"""Figures draw the newest complete run per run name and say which (repeats .1, .2 are not extra panels),
summarize runs cut short from their records, and list what they skip with the reason."""
import json
import os

import pytest

from experiments.figures import figure10_kernel_speedup, figure13_routing, figure16_working_set, render_all
from experiments.records import RecordWriter
from experiments.result_runs import summaries
from specter.errors import SpecterError


def make_run(root, name: str, complete: bool, tpot: float, mtime: float) -> None:
    directory = root / "main" / name
    directory.mkdir(parents=True)
    (directory / "summary.csv").write_text(f"system,dataset,tpot_ms\nspecter,AVG,{tpot}\n")
    (directory / "run.json").write_text(json.dumps({"complete": complete}))
    os.utime(directory / "run.json", (mtime, mtime))


def test_the_newest_complete_run_of_each_name_is_drawn(tmp_path, capsys):
    make_run(tmp_path, "tiny-dsv2-high", True, 1.0, 100)
    make_run(tmp_path, "tiny-dsv2-high.1", True, 2.0, 300)
    make_run(tmp_path, "tiny-dsv2-high.2", False, 3.0, 400)  # newer, cut short
    make_run(tmp_path, "tiny-qwen-low", False, 4.0, 200)  # the only run of its name
    data = summaries(tmp_path, "main")
    assert dict(zip(data.run, data.tpot_ms)) == {"tiny-dsv2-high": 2.0, "tiny-qwen-low": 4.0}
    err = capsys.readouterr().err
    assert "main/tiny-dsv2-high: drawing tiny-dsv2-high.1 (complete); skipped tiny-dsv2-high, tiny-dsv2-high.2" in err
    assert "main/tiny-qwen-low: drawing tiny-qwen-low (incomplete" in err


def test_a_run_cut_short_is_drawn_from_its_records(tmp_path, capsys):
    directory = tmp_path / "main" / "tiny-dsv2-high"
    directory.mkdir(parents=True)
    writer = RecordWriter(directory)
    for system, tpot in (("specter", 10.0), ("target_only", 30.0)):
        writer.add({"system": system, "dataset": "gsm8k", "prompt_id": 0, "repeat": 0, "status": "ok",
                    "tpot_ms": tpot, "generated_tokens": 8})
    (directory / "run.json").write_text(json.dumps({"complete": False, "config": {"num_prompts": 1}}))
    written = render_all(tmp_path)
    assert any(p.name == "fig14_main.png" for p in written)
    err = capsys.readouterr().err
    assert "skipped figure11_kernel: no kernel runs: experiment=kernel times Triton kernels on a CUDA GPU" in err
    assert "skipped figure7_depth: no depth runs" in err


def test_nothing_to_draw_is_one_line_with_the_reasons_above(tmp_path, capsys):
    (tmp_path / "main").mkdir()
    with pytest.raises(SpecterError, match="nothing to draw under"):
        render_all(tmp_path)
    assert capsys.readouterr().err.count("figures: skipped") >= 8


def test_figure10_draws_the_kernel_speedup_over_fp16(tmp_path):
    directory = tmp_path / "kernel" / "dsv2-high"
    directory.mkdir(parents=True)
    rows = ["model,tokens,system,median_ms"] + [f"dsv2,{t},fused_int4,{0.1 * t}" for t in (1, 4)] + \
        [f"dsv2,{t},fp16_expert_wise,{0.4 * t + 0.4}" for t in (1, 4)]
    (directory / "kernel.csv").write_text("\n".join(rows) + "\n")
    paths = figure10_kernel_speedup(tmp_path, tmp_path / "figures")
    drawn = (tmp_path / "figures" / "fig10_kernel_speedup.csv").read_text()
    assert len(paths) == 3 and "speedup" in drawn and ",8.0" in drawn and ",5.0" in drawn  # 0.8/0.1, 2.0/0.4


def test_figure13_with_one_dataset_draws_no_distance_matrix_and_keeps_models_apart(tmp_path):
    for run in ("tiny-dsv2-high", "tiny-qwen-high"):
        directory = tmp_path / "routing" / run
        directory.mkdir(parents=True)
        (directory / "routing_working_sets.csv").write_text("dataset,working_set\ngsm8k,3\ngsm8k,4\n")
        (directory / "routing_js.csv").write_text("dataset_a,dataset_b,js_distance\n")
    figure13_routing(tmp_path, tmp_path / "figures")
    drawn = (tmp_path / "figures" / "fig13_routing.csv").read_text()
    assert "tiny-dsv2-high" in drawn and "tiny-qwen-high" in drawn


def test_figure16_leaves_out_batches_that_repeat_prompts(tmp_path):
    directory = tmp_path / "batch" / "tiny-dsv2-high"
    directory.mkdir(parents=True)
    rows = ["system,dataset,batch_size,tpot_ms,throughput_tok_s,working_set_mean"] + \
        [f"specter,AVG,{b},10,{b},{w}" for b, w in ((1, 2.0), (2, 3.0), (4, 3.0))]
    (directory / "summary.csv").write_text("\n".join(rows) + "\n")
    (directory / "run.json").write_text(json.dumps({"complete": True, "config": {"num_prompts": 1}}))
    assert "fewer than two batch sizes with distinct prompts" in figure16_working_set(tmp_path, tmp_path / "f")
    (directory / "run.json").write_text(json.dumps({"complete": True, "config": {"num_prompts": 2}}))
    figure16_working_set(tmp_path, tmp_path / "f")
    drawn = (tmp_path / "f" / "fig16_working_set.csv").read_text()
    assert drawn.count("specter,AVG") == 2  # B=1 and 2; B=4 repeated prompts
