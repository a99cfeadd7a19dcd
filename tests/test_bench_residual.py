"""scripts/bench_residual.py's split of a grouped load's host time (the timing itself needs a GPU)."""
import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_residual.py"
spec = importlib.util.spec_from_file_location("bench_residual", SCRIPT)
bench_residual = sys.modules.setdefault("bench_residual", importlib.util.module_from_spec(spec))
spec.loader.exec_module(bench_residual)


def test_a_group_splits_into_joining_loads_and_the_flush_its_last_load_adds():
    def load(sample, timed):  # 4 loads a group: three join (10-12 us), the last also flushes (+50 us)
        timed += [10.0 + sample, 11.0, 12.0, 61.0 + sample]

    issue, flush = bench_residual.issue_and_flush_us(load, group=4, loads=16)
    assert issue == 11.0 and flush == 62.0 - 11.0
