"""scripts/acceptance_noise.py: the target's noise along g against the draft's signal, on a tiny calibrated build."""
from __future__ import annotations

import subprocess
import sys

import pytest

from experiments.datasets import local_datasets
from tests.scripts import ROOT, load_script, script_path


@pytest.mark.skipif(not local_datasets(), reason="needs a local dataset file (SPECTER_DATA)")
def test_the_draft_signal_dominates_the_target_noise_along_g_in_bfloat16():
    row = load_script("acceptance_noise").measure("tiny-mixtral", None, "bfloat16", 64, seed=0)
    assert row["draft_g_rms"] > 1e-3  # the INT4 error is there
    assert 0 < row["noise_over_signal"] < 0.1, row  # rounding noise only


def test_no_local_dataset_is_a_one_line_error(tmp_path):
    run = subprocess.run([sys.executable, str(script_path("acceptance_noise")), "--models", "tiny-mixtral"],
                         capture_output=True, text=True, cwd=ROOT, env={"SPECTER_DATA": str(tmp_path), "PATH": ""})
    assert run.returncode != 0 and run.stderr.strip().splitlines()[-1].startswith("error: no local dataset")
