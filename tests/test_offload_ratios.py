"""benchmarks/offload_ratios.py: variants over Specter, file by file, and their spread over files."""
import csv

import pytest

from tests.scripts import load_script

ratios = load_script("offload_ratios")
COLUMNS = ["system", "tpot_ms", "tpot_min_ms", "tpot_max_ms", "tokens_match_resident", "model", "mem", "k"]


def write(path, rows):
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow(dict(zip(COLUMNS, row)))
    return path


def test_each_variant_is_compared_with_the_specter_row_of_its_own_file(tmp_path, capsys):
    a = write(tmp_path / "a.csv", [("target_only_resident", 70, 60, 80, 1.0, "dsv2", "low", 32),
                                   ("specter", 20, 19, 21, 1.0, "dsv2", "low", 32),
                                   ("specter_residual_transfer=true", 11, 10.5, 11.5, 1.0, "dsv2", "low", 32),
                                   ("specter", 18, 17, 19, 1.0, "dsv2", "high", 32),
                                   ("specter_residual_transfer=true", 10.8, 10, 11, 1.0, "dsv2", "high", 32)])
    b = write(tmp_path / "b.csv", [("specter", 25, 24, 26, 1.0, "dsv2", "low", 32),
                                   ("specter_residual_transfer=true", 17.5, 15, 20, 0.5, "dsv2", "low", 32)])
    ratios.main([str(a), str(b), "--mem", "low"])
    out = capsys.readouterr().out
    assert "residual_transfer=true: 11.00 ms (10.50-11.50) vs Specter 20.00 ms = 0.550x; tokens match 1.0" in out
    assert "17.50 ms (15.00-20.00) vs Specter 25.00 ms = 0.700x; tokens match 0.5" in out
    assert "median 0.625x Specter over 2 run(s) (min 0.550, max 0.700)" in out and " high " not in out


def test_a_k_sweep_compares_each_k_with_its_own_specter_row(tmp_path):
    rows = ratios.read_rows(write(tmp_path / "k.csv", [("specter_k8", 30, 29, 31, 1.0, "qwen", "high", 8),
                                                      ("specter_k16", 20, 19, 21, 1.0, "qwen", "high", 16),
                                                      ("specter_draft_ahead=true_k16", 15, 14, 16, 1.0, "qwen",
                                                       "high", 16)]))
    [record] = ratios.ratios(tmp_path / "k.csv", rows)
    assert record["variant"] == "draft_ahead=true_k16" and record["ratio"] == pytest.approx(0.75)


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("a,b\n1,2\n", "not a bench_offload CSV"),
    ("system,tpot_ms,model,mem\nspecter,20,dsv2,low\n", "no variant with a Specter row beside it"),
])
def test_bad_input_is_one_line_and_a_nonzero_exit(tmp_path, content, message):
    path = tmp_path / "x.csv"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit, match=message):
        ratios.main([str(path)])


def test_a_row_log_csv_compares_the_paper_design_with_specter(tmp_path):
    """bench_offload's rows as RowLog writes them (commit, host and workload first): specter_paper is the
    variant `paper`."""
    path = tmp_path / "offload.csv"
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["commit", "host", "workload", *COLUMNS, "tpot_over_paper"])
        writer.writeheader()
        for system, tpot in (("specter_paper", 25.0), ("specter", 15.0)):
            writer.writerow({"commit": "abc1234", "host": "h", "workload": "dsv2 mem=low", "system": system,
                             "tpot_ms": tpot, "model": "dsv2", "mem": "low", "k": 32})
    [record] = ratios.ratios(path, ratios.read_rows(path))
    assert record["variant"] == "paper" and record["ratio"] == pytest.approx(25 / 15) and record["spread"] == "?"
