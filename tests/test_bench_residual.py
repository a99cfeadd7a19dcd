"""benchmarks/bench_residual.py's split of a grouped load's host time (the timing itself needs a GPU)."""
from tests.scripts import load_script

bench_residual = load_script("bench_residual")


def test_a_group_splits_into_joining_loads_and_the_flush_its_last_load_adds():
    def load(sample, timed):  # 4 loads a group: three join (10-12 us), the last also flushes (+50 us)
        timed += [10.0 + sample, 11.0, 12.0, 61.0 + sample]

    issue, flush = bench_residual.issue_and_flush_us(load, group=4, loads=16)
    assert issue == 11.0 and flush == 62.0 - 11.0
