"""records.csv: a torn last row (a cut write) is dropped on resume and by summarize, with a message."""
import json

import pytest

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
    assert "torn last row" in capsys.readouterr().err
    assert len(resumed.rows) == 2 and not resumed.done(row("specter", 1))
    resumed.add(row("specter", 1))
    frame = read_records(tmp_path / "records.csv")
    assert list(frame.repeat) == [0, 0, 1] and list(frame.tpot_ms) == [10.0, 10.0, 11.0]
    assert (tmp_path / "records.csv").read_text().endswith("\n")


@pytest.mark.parametrize("newline", [b"", b"\n"])  # a cut write; and one that a tool closed with a newline
def test_a_last_row_cut_at_any_byte_is_dropped_and_its_case_decoded_again(tmp_path, newline, capsys):
    writer = RecordWriter(tmp_path)
    writer.add(row("specter", 0))
    writer.add({**row("target_only", 0), "mechanisms": "prefetch expert_wise", "accepted_length_histogram": '{"1": 2}'})
    path = tmp_path / "records.csv"
    whole = path.read_bytes()
    start = whole.rstrip(b"\r\n").rfind(b"\n") + 1  # where the last row begins
    for cut in range(start + 1, len(whole) - 2):  # every byte of it but its own line end
        path.write_bytes(whole[:cut] + newline)
        resumed = RecordWriter(tmp_path, resume=True)
        assert [r["system"] for r in resumed.rows] == ["specter"], cut
        assert resumed.done(row("specter", 0)) and not resumed.done(row("target_only", 0)), cut
        assert path.read_bytes() == whole[:start], cut  # cut from the file: the next row starts on its own line
    capsys.readouterr()


def test_summarize_drops_a_torn_last_line(tmp_path, capsys):
    writer = RecordWriter(tmp_path)
    writer.add(row("specter", 0))
    (tmp_path / "run.json").write_text(json.dumps({"config": {"experiment": {"name": "main"}}}))
    with open(tmp_path / "records.csv", "a") as f:
        f.write("target_only,gsm8k,0,0,4,,1,ok,1" + ",x" * 40)  # a row with too many fields and no newline
    summary = summarize_dir(tmp_path)
    assert "torn last row" in capsys.readouterr().err
    assert set(summary.system) == {"specter"}


def test_a_file_torn_inside_its_header_is_rewritten_on_resume(tmp_path, capsys):
    (tmp_path / "records.csv").write_text("system,dataset,pro")
    writer = RecordWriter(tmp_path, resume=True)
    writer.add(row("specter", 0))
    assert list(read_records(tmp_path / "records.csv").system) == ["specter"]


def test_the_printed_summary_counts_prompts_in_whole_numbers_and_explains_the_ratio():
    import pandas as pd

    from experiments.records import FIELDS, format_table, summarize
    rows = [{**dict.fromkeys(FIELDS, ""), **row(system, 0), "prompt_id": p, "tpot_ms": tpot} for p in (0, 1)
            for system, tpot in (("specter", 10.0), ("target_only", 5.5))]
    summary = summarize(pd.DataFrame(rows))
    assert list(summary.prompts) == [2, 2, 2, 2]  # gsm8k and AVG rows
    table = format_table(summary)
    assert "2.000" not in table and "x Specter: TPOT / Specter's" in table and "medians over decodes" in table
    assert summary[summary.system == "target_only"].tpot_over_specter.iloc[0] == 0.55  # Specter slower


def test_the_console_table_shows_medians_in_at_most_120_columns_and_unavailable_rows_as_lines():
    import pandas as pd

    from experiments.records import FIELDS, format_table, summarize
    tpots = (4.0, 4.8, 5.0, 116.8)  # one slow decode: the mean is 32.65, the median 4.9
    rows = [{**dict.fromkeys(FIELDS, ""), **row("specter", r), "tpot_ms": t, "acceptance_rate": 0.9,
             "decode_h2d_bytes_per_token": 2e6, "tokens_match_target": "yes"} for r, t in enumerate(tpots)]
    rows.append({**row("mo_sm", 0), "status": "unavailable: " + "a long reason " * 20})
    summary = summarize(pd.DataFrame(rows))
    specter = summary[(summary.system == "specter") & (summary.dataset == "gsm8k")].iloc[0]
    assert specter.tpot_median_ms == 4.9 and specter.tpot_mean_ms == pytest.approx(32.65)
    assert {"tpot_min_ms", "tpot_max_ms", "hit_rate", "ttft_ms", "tokens_identical"} <= set(summary.columns)
    table = format_table(summary)
    lines = table.splitlines()
    assert max(len(line) for line in lines) <= 120
    assert lines[0].split() == ["system", "dataset", "TPOT", "ms", "x", "Specter", "accept", "MB/token", "same",
                                "tokens"]
    assert "4.900" in lines[1] and "32.6" not in table
    assert any(line.startswith("mo_sm / gsm8k: unavailable: a long reason") for line in lines)


def test_a_file_from_before_new_columns_is_resumed_with_its_own_header(tmp_path):
    from experiments.records import FIELDS, summarize

    old_fields = [f for f in FIELDS if f not in ("io_floor_ms", "invocation")]
    (tmp_path / "records.csv").write_text(",".join(old_fields) + "\n")
    writer = RecordWriter(tmp_path, resume=True)
    writer.add(row("specter", 0) | {"io_floor_ms": 5.0})
    assert (tmp_path / "records.csv").read_text().splitlines()[0] == ",".join(old_fields)
    frame = read_records(tmp_path / "records.csv")
    assert list(frame.columns) == old_fields and list(frame.tpot_ms) == [10.0]
    summary = summarize(frame)
    assert "io_floor_ms" not in summary and list(summary.tpot_median_ms) == [10.0, 10.0]  # gsm8k, AVG


def test_the_summary_has_the_floor_where_measured():
    import pandas as pd

    from experiments.records import summarize

    from experiments.records import format_table

    rows = [row("specter", r) | {"io_floor_ms": 5.0} for r in (0, 1)]
    rows += [row("target_only", 0), row("mo_sm", 0) | {"tpot_ms": 40.0, "io_floor_ms": 3.0},
             row("specmoeoff_sm", 0) | {"tpot_ms": 30.0, "io_floor_ms": 4.0}]
    frame = pd.DataFrame(rows).assign(tokens_match_target="")
    summary = summarize(frame).set_index(["system", "dataset"])
    specter = summary.loc[("specter", "gsm8k")]
    assert specter.tpot_median_ms == 10.5 and specter.tpot_over_io_floor == 10.5 / 5.0
    assert pd.isna(summary.loc[("target_only", "gsm8k")].tpot_over_io_floor)
    assert specter.lowest_peer_floor == "mo_sm" and specter.tpot_over_peer_floor == 10.5 / 3.0  # the lowest peer floor
    assert pd.isna(summary.loc[("mo_sm", "gsm8k")].tpot_over_peer_floor)  # only Specter's TPOT goes over the peers'
    table = format_table(summarize(frame))
    assert "specter / gsm8k: TPOT 3.50x mo_sm's I/O floor, the lowest among the peers" in table and "x floor" in table


def test_summarize_by_host_splits_rows_at_each_invocations_first_row(tmp_path):
    import pytest
    writer = RecordWriter(tmp_path)
    for repeat in range(3):
        writer.add(row("specter", repeat))  # tpot 10, 11, 12
        writer.add(row("target_only", repeat) | {"tpot_ms": 30.0 + 10 * repeat})  # 30, 40, 50
    run = {"config": {"experiment": {"name": "main"}}}
    (tmp_path / "run.json").write_text(json.dumps(run))
    with pytest.raises(ValueError, match="lists no invocations"):
        summarize_dir(tmp_path, by_host=True)
    run["invocations"] = [{"first_row": None, "machine": {"host_op_us": 4.7}},  # from before the list: row 0
                          {"first_row": 4, "machine": {"host_op_us": 9.0}}]
    (tmp_path / "run.json").write_text(json.dumps(run))
    summary = summarize_dir(tmp_path, by_host=True).set_index(["system", "host_op_us"])
    assert (tmp_path / "summary-by-host.csv").is_file() and not (tmp_path / "summary.csv").exists()
    assert summary.loc[("specter", 4.7), "tpot_median_ms"] == 10.5 and summary.loc[("specter", 9.0), "tpot_mean_ms"] == 12
    assert summary.loc[("target_only", 4.7), "tpot_over_specter"] == pytest.approx(35 / 10.5)
    assert summary.loc[("target_only", 9.0), "tpot_over_specter"] == pytest.approx(50 / 12)
