"""experiments.medians: the per-system medians that the reference NOTES tables quote."""
from pathlib import Path

import pandas as pd
import pytest

from experiments.medians import main, system_medians
from experiments.records import read_records

ROOT = Path(__file__).resolve().parents[1]
S26_LOW = ROOT / "results" / "reference" / "calibrated-h200" / "issue21-s26-dsv2-low-k32-r2"


def test_medians_of_a_published_run_are_the_notes_numbers():
    table = system_medians(read_records(S26_LOW / "records.csv")).set_index("system")
    both = table.loc["specter_residual_ahead_compile_full_wave_group_copies"]
    assert both.cases == 6 and both.tokens_match_target == 6
    assert both.tpot_ms == pytest.approx(14.41, abs=0.01) and both.x_specter == pytest.approx(0.603, abs=0.001)
    assert both.mo_sm_over_it == pytest.approx(4.72, abs=0.01)
    assert pd.isna(both.gb_per_token)  # its records predate decoding's bytes per token (the one definition)
    assert table.loc["target_only"].tokens_match_target == 0  # the reference itself is not checked


def test_unmeasured_rows_and_dashes_are_left_out():
    rows = [{"system": "specter", "status": "ok", "tpot_ms": t, "generated_tokens": 10, "draft_ms": 10.0,
             "verify_ms": 20.0, "wait_ms": 5.0, "decode_h2d_bytes_per_token": 1e9, "io_floor_ms": 2.0,
             "mean_accepted_length": 3.0, "tokens_match_target": "yes"} for t in (1.0, 2.0, 9.0)]
    rows.append({**rows[0], "status": "unavailable: no GPU", "tpot_ms": "-"})
    rows.append({**rows[0], "system": "mo_sm", "tpot_ms": 6.0, "draft_ms": "-", "verify_ms": "-"})
    table = system_medians(pd.DataFrame(rows)).set_index("system")
    assert table.loc["specter"].cases == 3 and table.loc["specter"].tpot_ms == 2.0
    assert table.loc["specter"].draft_ms_per_token == 1.0 and table.loc["specter"].mo_sm_over_it == 3.0
    assert pd.isna(table.loc["mo_sm"].draft_ms_per_token) and table.loc["mo_sm"].x_specter == 3.0
    assert table.loc["specter"].gb_per_token == 1.0 and table.loc["specter"].io_floor_ms == 2.0


def test_ratios_pair_only_cases_of_one_process():
    def row(system, prompt, tpot, invocation):
        return {"system": system, "dataset": "d", "prompt_id": prompt, "repeat": 0, "invocation": invocation,
                "status": "ok", "tpot_ms": tpot, "generated_tokens": 10}
    rows = [row("specter", 0, 1.0, 0), row("mo_sm", 0, 4.0, 0),  # one host
            row("specter", 1, 10.0, 1), row("mo_sm", 2, 80.0, 2)]  # resumed elsewhere: prompt 1 and 2 never pair
    table = system_medians(pd.DataFrame(rows)).set_index("system")
    assert table.loc["mo_sm"].x_specter == 4.0 and table.loc["specter"].mo_sm_over_it == 4.0


def test_a_missing_or_empty_run_is_one_line_and_exit_2(tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 2
    (tmp_path / "records.csv").write_text("system,status,tpot_ms\nspecter,unavailable: x,-\n")
    assert main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("error:") == 2
    assert main([str(S26_LOW)]) == 0 and "specter_residual_ahead_compile" in capsys.readouterr().out
