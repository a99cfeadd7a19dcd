"""experiments.table: the results table of record, one block per run, every ratio from that run."""
import json

from experiments.records import RecordWriter, unavailable
from experiments.table import main

RUN = {"complete": True, "gpu": "NVIDIA H200", "git_commit": "abcdef123", "h2d_gbps": 50.0,
       "config": {"experiment": {"name": "main"}, "model": {"name": "dsv2", "weights": "calibrated"},
                  "mem": {"name": "low"}, "repeats": 1}}


def write_run(directory, rows: dict, invocation: int = 0) -> None:
    """rows: system -> [(tpot, decoding bytes per token, tokens equal)] per prompt."""
    directory.mkdir(parents=True)
    (directory / "run.json").write_text(json.dumps(RUN))
    writer = RecordWriter(directory, h2d_gbps=50.0, invocation=invocation)
    for system, cases in rows.items():
        for prompt, (tpot, nbytes, same) in enumerate(cases):
            writer.add({"system": system, "dataset": "gsm8k", "prompt_id": prompt, "repeat": 0, "k": 32,
                        "status": "ok", "tpot_ms": tpot, "decode_h2d_bytes_per_token": nbytes,
                        "io_floor_ms": nbytes / 50e6 if nbytes else "", "tokens_match_target": same,
                        "generated_tokens": 128})
    writer.add(unavailable({"system": "llama_cpp", "dataset": "*", "prompt_id": -1}, "no CUDA build staged"))


def test_each_run_is_one_block_with_its_own_ratios_and_floors(tmp_path, capsys):
    write_run(tmp_path / "main" / "dsv2-low", {
        "specter": [(10.0, 5e8, "yes"), (12.0, 5e8, "yes")], "specter_paper": [(20.0, 8e8, "yes"), (24.0, 8e8, "yes")],
        "target_only": [(60.0, None, "")], "mo_sm": [(40.0, 4e8, "yes"), (48.0, 4e8, "no")]})
    write_run(tmp_path / "main" / "qwen-high", {"specter": [(30.0, 5e8, "yes")], "mo_sm": [(30.0, 5e8, "yes")]})
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    low, high = out.split("### ")[1:]
    assert low.startswith("dsv2 (calibrated), mem=low, K=32: 7 decodes (gsm8k; 1 repeat), NVIDIA H200, commit "
                          "abcdef1, H2D 50.0 GB/s")
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in low.splitlines()
            if line.startswith("| ") and "---" not in line and "system" not in line}
    assert rows["specter"] == ["11.00", "1.00", "500.0", "10.00", "1.10", "2/2 equal"]
    assert rows["mo_sm"][:5] == ["44.00", "4.00", "400.0", "8.00", "5.50"]
    assert rows["mo_sm"][5] == "1/2 equal, 1 differ (not classified)"
    assert rows["target_only"][-1] == "(reference)" and rows["target_only"][2] == "-"  # moves nothing: no floor
    assert "- specter: TPOT 1.38x mo_sm's I/O floor (8.00 ms), the lowest among the other systems" in low
    assert "- llama_cpp: unavailable: no CUDA build staged" in low
    assert "| mo_sm | 30.00 | 1.00 |" in high  # its own run's ratio, never one across the two


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 2
    assert main([str(tmp_path)]) == 2
    write_run(tmp_path / "r", {"specter": [(1.0, 1e6, "yes")]})
    (tmp_path / "t.md").write_text("kept")
    assert main([str(tmp_path), "--out", str(tmp_path / "t.md")]) == 2 and (tmp_path / "t.md").read_text() == "kept"
    err = capsys.readouterr().err
    assert err.count("error:") == 3 and err.count("\n") == 3


def test_readme_block_is_regenerated_in_place_and_bad_blocks_are_one_line(tmp_path, capsys):
    write_run(tmp_path / "runs" / "dsv2-low", {"specter": [(10.0, 5e8, "yes")], "mo_sm": [(40.0, 4e8, "yes")]})
    readme = tmp_path / "README.md"
    readme.write_text("# T\n\n<!-- results-table: runs -->\nstale\n<!-- /results-table -->\n\nafter\n")
    assert main(["--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "stale" not in text and "| specter | 10.00 | 1.00 |" in text and text.endswith("-->\n\nafter\n")
    assert main(["--readme", str(readme)]) == 0 and readme.read_text() == text  # idempotent
    (tmp_path / "bad.md").write_text("no block\n")
    (tmp_path / "gone.md").write_text("<!-- results-table: nowhere -->\n<!-- /results-table -->\n")
    assert main(["--readme", str(tmp_path / "bad.md")]) == 2 and main(["--readme", str(tmp_path / "gone.md")]) == 2
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 3 and (tmp_path / "bad.md").read_text() == "no block\n"


def test_the_readme_table_is_the_committed_table_of_record():
    """README.md's results block equals what the committed run directories render (regenerate with --readme)."""
    from pathlib import Path

    from experiments.table import readme_with_table
    root = Path(__file__).resolve().parent.parent
    text = (root / "README.md").read_text()
    assert readme_with_table(text, root) == text


def test_a_run_whose_decode_beat_its_measured_link_warns_instead_of_comparing_floors(tmp_path, capsys):
    directory = tmp_path / "main" / "dsv2-low"
    directory.mkdir(parents=True)
    (directory / "run.json").write_text(json.dumps(RUN))
    writer = RecordWriter(directory, h2d_gbps=50.0)
    for system, tpot, copy_gbps in (("specter", 10.0, 49.0), ("mo_sm", 40.0, 55.0)):  # mo_sm's copies beat 50 GB/s
        writer.add({"system": system, "dataset": "gsm8k", "prompt_id": 0, "repeat": 0, "k": 32, "status": "ok",
                    "tpot_ms": tpot, "decode_h2d_bytes_per_token": 4e8, "io_floor_ms": 8.0, "link_gbps": 50.0,
                    "h2d_gbps": copy_gbps, "tokens_match_target": "yes", "generated_tokens": 128})
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "warning: mo_sm moved data 1.10x faster than the measured link rate" in out
    assert "the lowest among the other systems" not in out
