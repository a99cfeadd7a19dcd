"""scripts/bench_host_experts.py on CPU: one tiny expert's rows, with the copy marked unavailable."""

import pytest
import torch

from tests.scripts import load_script

bench_host_experts = load_script("bench_host_experts")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU rows (a GPU adds the measured copy)")
def test_rows_per_thread_count_and_token_count():
    threads = torch.get_num_threads()
    rows = bench_host_experts.bench("tiny-qwen", torch.bfloat16, [1, 2], repeats=1, cold_mb=0.1)
    assert [(r["threads"], r["tokens"]) for r in rows] == [(t, n) for t in (1, 2) for n in bench_host_experts.TOKENS]
    assert all(r["cpu_ms"] > 0 and r["cold_cpu_ms"] > 0 and r["estimate_ms"] >= 0 and r["worker_estimate_ms"] >= 0
               for r in rows)
    assert all(r["copy_ms"] == "unavailable: no CUDA device" and r["dtype"] == "bfloat16" for r in rows)
    assert torch.get_num_threads() == threads  # restored
