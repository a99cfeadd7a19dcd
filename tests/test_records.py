"""records.csv: a torn last line (a cut write) is dropped on resume and by summarize, with a message."""
import json

from experiments.records import RecordWriter, read_records
from experiments.summarize import summarize_dir


def row(system: str, repeat: int) -> dict:
    return {"system": system, "dataset": "gsm8k", "prompt_id": 0, "repeat": repeat, "k": 4, "prefix_tokens": "",
            "batch_size": 1, "status": "ok", "tpot_ms": 10.0 + repeat, "generated_tokens": 8}


def test_a_torn_last_line_is_dropped_and_cut_on_resume(tmp_path, capsys):
    writer = RecordWriter(tmp_path)
    writer.add(row("specter", 0))
    writer.add(row("target_only", 0))
    with open(tmp_path / "records.csv", "a") as f:
        f.write("specter,gsm8k,0,1,4,,1,ok,11.")  # the write of repeat 1, cut
    resumed = RecordWriter(tmp_path, resume=True)
    assert "torn last line" in capsys.readouterr().err
    assert len(resumed.rows) == 2 and not resumed.done(row("specter", 1))
    resumed.add(row("specter", 1))
    frame = read_records(tmp_path / "records.csv")
    assert list(frame.repeat) == [0, 0, 1] and list(frame.tpot_ms) == [10.0, 10.0, 11.0]
    assert (tmp_path / "records.csv").read_text().endswith("\n")


def test_summarize_drops_a_torn_last_line(tmp_path, capsys):
    writer = RecordWriter(tmp_path)
    writer.add(row("specter", 0))
    (tmp_path / "run.json").write_text(json.dumps({"config": {"experiment": {"name": "main"}}}))
    with open(tmp_path / "records.csv", "a") as f:
        f.write("target_only,gsm8k,0,0,4,,1,ok,1" + ",x" * 40)  # a row with too many fields and no newline
    summary = summarize_dir(tmp_path)
    assert "torn last line" in capsys.readouterr().err
    assert set(summary.system) == {"specter"}


def test_a_file_torn_inside_its_header_is_rewritten_on_resume(tmp_path, capsys):
    (tmp_path / "records.csv").write_text("system,dataset,pro")
    writer = RecordWriter(tmp_path, resume=True)
    writer.add(row("specter", 0))
    assert list(read_records(tmp_path / "records.csv").system) == ["specter"]


def test_the_printed_summary_counts_prompts_in_whole_numbers_and_explains_the_ratio():
    import pandas as pd

    from experiments.records import format_table, summarize
    from experiments.records import FIELDS
    rows = [{**dict.fromkeys(FIELDS, ""), **row(system, 0), "prompt_id": p, "tpot_ms": tpot} for p in (0, 1)
            for system, tpot in (("specter", 10.0), ("target_only", 5.5))]
    summary = summarize(pd.DataFrame(rows))
    assert list(summary.prompts) == [2, 2, 2, 2]  # gsm8k and AVG rows
    table = format_table(summary)
    assert "2.000" not in table and "tpot_over_specter: this system's TPOT / Specter's" in table
    assert summary[summary.system == "target_only"].tpot_over_specter.iloc[0] == 0.55  # Specter slower
