"""Where each token's time went (specter.token_time): the parts sum to TPOT, stalls split into copies and
rebuilds at the awaited rebuild's start, the prefill's copies left out; every system reports them."""
import pytest
import torch

import specter
from baselines.mixtral_offloading import MixtralOffloading
from baselines.target_only import TargetOnly
from experiments.records import TPOT_PARTS, format_table, record, summarize
from specter.offload.copy_log import CopyLog
from specter.token_time import token_time
from tests.conftest import prompt


def test_the_parts_of_a_synthetic_timeline():
    """Two windows between commits at 10 and 40 ms (3 tokens): drafts 2 + 3 ms, verify passes 8 + 9 ms holding
    a copy stall of 3 ms (2 on the copy, 1 on its rebuild) and a 0.5 ms rebuild on the compute stream; a
    prefill stall at 4 ms is not decoding's."""
    phases = {"draft": [(11, 13), (25, 28)], "verify": [(13, 21), (28, 37)]}
    stalls = [(4.0, 5.0, 0.0), (14.0, 2.0, 1.0)]
    parts = token_time(phases, (10.0, 40.0), stalls, [(30.0, 30.5)], tokens=3)
    assert parts == pytest.approx({"tpot_draft_ms": 2.5, "tpot_copy_wait_ms": 1.0, "tpot_rebuild_ms": 0.75,
                                   "tpot_target_ms": (17 - 2 - 1.5) / 2, "tpot_host_ms": (30 - 5 - 17) / 2})
    assert sum(parts.values()) == pytest.approx(30 / 2)  # TPOT


def test_a_stall_splits_at_the_start_of_the_rebuild_it_waits_for():
    log = CopyLog()
    copy_end, decode_start, decode_end = 5.0, 6.0, 9.0
    log.decodes.append((decode_start, decode_end))
    log.stalls += [(4.0, 10.0, (copy_end, decode_end)),  # the decode ends last: 6..10 is the rebuild's
                   (20.0, 22.0, (21.5,)),  # a plain copy: all the copy's
                   (30.0, 31.0, ())]  # a synchronous copy (CPU)
    log.rebuilds.append((40.0, 41.0))
    stalls, rebuilds = log.critical_path_ms(lambda t: t)
    assert stalls == [(4.0, 2.0, 4.0), (20.0, 2.0, 0.0), (30.0, 1.0, 0.0)] and rebuilds == [(40.0, 41.0)]


def sum_of_parts(stats: dict) -> float:
    return sum(stats[c] for c in TPOT_PARTS)


@pytest.mark.parametrize("system", ["specter", "specter_resident", "target_only", "mo_sm"])
def test_every_system_reports_parts_that_sum_to_its_tpot(system):
    model = specter.load_model("tiny-qwen", device="cpu", dtype=torch.bfloat16)
    engine = {"specter": lambda: specter.SpecterEngine(model, specter.SpecterConfig(resident_experts_per_layer=3)),
              "specter_resident": lambda: specter.SpecterEngine(model, specter.SpecterConfig()),
              "target_only": lambda: TargetOnly(model),
              "mo_sm": lambda: MixtralOffloading(model, 3)}[system]()
    stats = engine.generate(prompt(), 16).stats
    assert all(stats[c] >= 0 for c in TPOT_PARTS)
    assert sum_of_parts(stats) == pytest.approx(stats["tpot_ms"], rel=1e-6)
    assert (stats["tpot_draft_ms"] > 0) == system.startswith("specter")


def test_records_and_the_console_carry_the_parts():
    stats = {"tpot_ms": 10.0, "tpot_draft_ms": 1.0, "tpot_copy_wait_ms": 5.0, "tpot_rebuild_ms": 2.0,
             "tpot_target_ms": 1.5, "tpot_host_ms": 0.5, "generated_tokens": 8}
    result = specter.metrics.GenerationResult([1] * 8, stats)
    row = record({"system": "specter", "dataset": "gsm8k", "prompt_id": 0, "repeat": 0}, result, None)
    assert row["tpot_copy_wait_ms"] == 5.0
    import pandas as pd
    text = format_table(summarize(pd.DataFrame([row])))
    assert "time per token, ms" in text and "copies" in text and "5.000" in text


def test_a_copy_rate_within_the_links_timing_noise_is_not_a_warning():
    """A paper-design row whose copies read 0.1% above the link's best trial (an H100 run) is noise; 3% is not."""
    import pandas as pd
    from experiments.records import beats_link, rate_over_link
    rows = pd.DataFrame({"h2d_gbps": [55.261, 56.9], "decode_h2d_bytes_per_token": [1.8e9, 1.8e9],
                         "tpot_ms": [34.8, 34.8], "link_gbps": [55.2, 55.2]})
    assert beats_link(rate_over_link(rows)).tolist() == [False, True]
