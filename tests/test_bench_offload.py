"""scripts/bench_offload.py's summary of runs (on CPU stats: the script itself needs a GPU)."""
import importlib.util
from pathlib import Path

import torch

import specter
from baselines.target_only import TargetOnly
from tests.conftest import prompt

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_offload.py"
spec = importlib.util.spec_from_file_location("bench_offload", SCRIPT)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_summary_rows_line_and_table(capsys):
    model = specter.load_model("tiny-qwen", device="cpu", dtype=torch.float32)
    prompts = [prompt(), prompt("def f(x):")]
    reference = [r["tokens"] for r in bench.run(TargetOnly(model), prompts, 12)]
    engine = specter.SpecterEngine(model, specter.SpecterConfig(k=3, resident_experts_per_layer=2))
    row = bench.summarize("specter", bench.run(engine, prompts, 12), reference)
    assert row["tokens_match_resident"] == 1.0 and row["io_floor_ms_per_token"] > 0
    assert all(row[f"copy_idle_{p}_ms_per_token"] >= 0 for p in ("draft", "verify", "between"))
    assert "TPOT / I/O floor" in bench.row_line(row) and "copy idle ms/token" in bench.row_line(row)
    bench.print_table([dict(row, k=3)])  # no target-only or eager rows: the ratios they anchor are left out
    out = capsys.readouterr().out
    assert "specter: TPOT / I/O floor" in out and "draft step" not in out
