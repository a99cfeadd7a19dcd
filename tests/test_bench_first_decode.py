"""bench_first_decode's modes and its first-against-second accounting, on the CPU with the tiny model."""
import pytest
import torch

import specter
from benchmarks import bench_first_decode as bench


def test_each_mode_gets_prompts_of_its_own():
    prompts = {"gsm8k": ["a", "b", "c", "d"], "humaneval": ["e", "f", "g", "h"]}
    split = bench.disjoint_prompts(prompts, 2, 2)
    assert split == [{"gsm8k": ["a", "b"], "humaneval": ["e", "f"]}, {"gsm8k": ["c", "d"], "humaneval": ["g", "h"]}]


def test_the_one_off_is_the_first_decode_over_the_second_times_the_tokens():
    rows = [{"dataset": "gsm8k", "prompt": 0, "decode": 1, "tpot_ms": 14.0, "tpot_target_ms": 8.0, "tokens": 11},
            {"dataset": "gsm8k", "prompt": 0, "decode": 2, "tpot_ms": 12.0, "tpot_target_ms": 6.0, "tokens": 11},
            {"dataset": "gsm8k", "prompt": 1, "decode": 1, "tpot_ms": 10.0, "tpot_target_ms": 5.0, "tokens": 11},
            {"dataset": "gsm8k", "prompt": 1, "decode": 2, "tpot_ms": 10.0, "tpot_target_ms": 5.0, "tokens": 11}]
    summary = bench.one_off(rows)
    assert summary["first_tpot_ms"] == 12.0 and summary["second_tpot_ms"] == 11.0
    assert summary["first_target_ms"] == 6.5 and summary["second_target_ms"] == 5.5
    assert summary["one_off_ms_per_decode"] == pytest.approx((2.0 * 10 + 0.0) / 2)


def test_a_mode_decodes_each_prompt_twice_and_restores_the_backend_setting():
    model = specter.load_model("tiny", device="cpu", dtype=torch.float32)
    ids = torch.tensor([model.tokenizer("Natalia sold clips")["input_ids"][:8]])
    before = torch.backends.cuda.cudnn_sdp_enabled()
    config = specter.SpecterConfig(k=3, resident_experts_per_layer=2)
    rows = bench.measure_mode(model, config, not before, {"gsm8k": [ids]}, 8)
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    assert [(r["prompt"], r["decode"]) for r in rows] == [(0, 1), (0, 2)]
    assert all(r["tokens"] == 8 and r["tpot_ms"] > 0 for r in rows)


def test_the_kernels_compiled_are_named_from_the_new_cache_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "_slot_down_kernel.json").write_text("{}")
    before = bench.triton_entries()
    for entry, name in (("h1", "_align_kernel"), ("h2", "_slot_gate_up_kernel")):
        (tmp_path / entry).mkdir()
        (tmp_path / entry / f"{name}.json").write_text("{}")
        (tmp_path / entry / f"__grp__{name}.json").write_text("{}")
    assert bench.kernel_names(bench.triton_entries() - before) == "_align_kernel+_slot_gate_up_kernel"
    assert bench.kernel_names(set()) == ""
