"""benchmarks/bench_wave_host.py: a clear error without a GPU; on a GPU, one row per wave size, checked rows."""
import subprocess
import sys

import pytest
import torch

from tests.scripts import BENCHMARKS, load_script

bench_wave_host = load_script("bench_wave_host")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message a machine without a GPU gets")
def test_without_a_gpu_it_exits_with_one_line():
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_wave_host.py")], capture_output=True, text=True)
    assert done.returncode != 0 and done.stderr.strip() == "error: bench_wave_host.py needs a CUDA GPU"


def test_layer_shapes_come_from_the_registry():
    assert bench_wave_host.layer_shapes("dsv2") == (2048, 1408, 64, 6)
    assert bench_wave_host.layer_shapes("qwen") == (2048, 1408, 60, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_row_per_wave_size_and_way_with_positive_times():
    rows = bench_wave_host.bench("dsv2", tokens=9, repeats=3)
    ways = ("per_call", "prepared")
    assert [(r["wave"], r["way"]) for r in rows] == [(w, way) for w in bench_wave_host.WAVES for way in ways]
    assert all(r["host_us_per_wave"] > 0 and r["gpu_ms_per_wave"] > 0 for r in rows)
