"""scripts/bench_zero_copy.py: a clear one-line error on a machine without a GPU (its rows are GPU measurements)."""
import subprocess
import sys

import pytest
import torch

from tests.scripts import SCRIPTS


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message a machine without a GPU gets")
def test_without_a_gpu_it_exits_with_one_line():
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_zero_copy.py")], capture_output=True, text=True)
    assert done.returncode != 0 and done.stderr.strip() == "error: bench_zero_copy.py needs a CUDA GPU"
