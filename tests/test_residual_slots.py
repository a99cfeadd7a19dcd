"""Residual-coded slots: slot memory that keeps residual blobs on the device, so a reload moves no bytes; lossless."""
import pytest
import torch

import specter
from specter.errors import SpecterError
from specter.offload.blob_slots import BlobSlots, HeldRow, blob_rows_per_layer
from tests.conftest import TINY_MODELS, prompt
from tests.test_default_config import hf_greedy_in

NEW = 24
CODED = dict(resident_experts_per_layer=6, residual_slots=3)  # 2 pooled, 1 own 16-bit slot, 3 slots' memory coded


def test_blob_slots_keep_each_layers_blobs_least_recently_loaded_first():
    slots = BlobSlots(layers=2, per_layer=2)
    assert slots.rows == 4
    assert slots.place(1, 7) == HeldRow(2, False, 4)  # layer 1 owns rows 2 and 3, the first free one first
    assert slots.place(1, 8) == HeldRow(3, False, 4)
    assert slots.place(1, 7) == HeldRow(2, True, 4)  # still held: present, and now the most recent
    assert slots.place(1, 9) == HeldRow(3, False, 4)  # expert 8, the least recently loaded, gives its row up
    assert not slots.holds(1, 8) and slots.holds(1, 7) and slots.place(0, 7) == HeldRow(0, False, 4)
    slots.clear()
    assert not slots.holds(1, 7) and slots.place(1, 7) == HeldRow(2, False, 4)
    assert blob_rows_per_layer(3, 1000, 540) == 5
    with pytest.raises(ValueError):
        BlobSlots(1, 0)


def test_residual_slots_switch_themselves_off_with_a_reason_and_are_capped():
    model = specter.load_model("tiny-qwen", device="cpu", dtype=torch.bfloat16)

    def resolved(**fields):
        engine = specter.SpecterEngine(model, specter.SpecterConfig(**fields))
        return engine.mechanisms["residual_slots"], engine.config.residual_slots

    assert resolved(resident_experts_per_layer=6) == ("off: not asked", 0)
    assert resolved(**CODED) == ("on", 3)
    assert resolved(resident_experts_per_layer=6, residual_slots=9) == ("on", 3)  # each layer keeps a 16-bit slot
    assert resolved(residual_slots=2) == ("off: every expert resident on the device (nothing is loaded)", 0)
    state, coded = resolved(**CODED, residual_transfer=False)
    assert state == "off: needs residual transfer (residual_transfer off: not asked)" and coded == 0
    assert resolved(resident_experts_per_layer=3, residual_slots=1)[0].startswith("off: needs at least 2 slots")
    fp32 = specter.load_model("tiny-qwen", device="cpu", dtype=torch.float32)
    assert specter.SpecterEngine(fp32, specter.SpecterConfig(**CODED)).mechanisms["residual_slots"].startswith(
        "off: needs residual transfer (residual_transfer off:")
    for bad in (-1, True, 1.5):
        with pytest.raises(SpecterError, match="residual_slots must be an integer >= 0"):
            specter.SpecterConfig(residual_slots=bad)


@pytest.mark.parametrize("name", TINY_MODELS)
def test_coded_slots_equal_hf_greedy_and_spare_the_bytes_of_every_reload_they_hold(name):
    """bf16 (residual transfer runs; on the CPU its decode is the torch reference): the same tokens as HF's greedy
    decode; against the same 16-bit slots without the coded memory, the same loads, minus the bytes of the
    loads whose blob was still held. (Whether coded memory beats 16-bit slots in the same memory depends on the
    workload: `benchmarks/sim_offload_bytes.py`.)"""
    model = specter.load_model(name, device="cpu", dtype=torch.bfloat16)
    ids = prompt("Natalia sold clips")
    coded = specter.SpecterEngine(model, specter.SpecterConfig(**CODED, k=4)).generate(ids, NEW)
    plain = specter.SpecterEngine(model, specter.SpecterConfig(resident_experts_per_layer=3, k=4)).generate(ids, NEW)
    assert coded.token_ids == plain.token_ids == hf_greedy_in(name, torch.bfloat16, ids, NEW), name
    assert coded.stats["mechanisms"]["residual_slots"] == "on" and coded.stats["blob_hits"] > 0
    assert plain.stats["blob_hits"] == 0
    loads = ("misses", "prefetch_loads", "residual_decodes")
    assert [coded.stats[key] for key in loads] == [plain.stats[key] for key in loads]
    assert coded.stats["h2d_bytes"] < plain.stats["h2d_bytes"]


def test_a_batch_of_32_with_coded_slots_gives_each_requests_greedy_tokens():
    model = specter.load_model("tiny-qwen", device="cpu", dtype=torch.bfloat16)
    texts = ["Natalia sold clips", "def f(x):", "The tower is", "Robert Boulter is"]
    prompts = [prompt(f"{texts[i % 4]} {i}").tolist()[0] for i in range(32)]
    batch = specter.SpecterEngine(model, specter.SpecterConfig(**CODED)).generate(prompts, 8)
    reference = specter.SpecterEngine(model, specter.SpecterConfig.paper(resident_experts_per_layer=6))
    assert [r.token_ids for r in batch] == [r.token_ids for r in reference.generate(prompts, 8)]
    assert batch[0].stats["mechanisms"]["residual_slots"] == "on"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-qwen", "tiny-mixtral"])
def test_coded_slots_on_cuda_give_the_same_tokens_with_fewer_bytes(name):
    """The CUDA path (blobs kept in the staging rows, decodes reading them in groups) against the same 16-bit slots
    without the coded memory and against every expert resident."""
    model = specter.load_model(name, device="cuda", dtype=torch.bfloat16)
    ids = prompt("Natalia sold clips")
    resident = specter.SpecterEngine(model, specter.SpecterConfig()).generate(ids, NEW)
    coded = specter.SpecterEngine(model, specter.SpecterConfig(**CODED, k=4)).generate(ids, NEW)
    plain = specter.SpecterEngine(model, specter.SpecterConfig(resident_experts_per_layer=3, k=4)).generate(ids, NEW)
    assert coded.token_ids == plain.token_ids == resident.token_ids, name
    assert coded.stats["blob_hits"] > 0 and coded.stats["h2d_bytes"] < plain.stats["h2d_bytes"]
