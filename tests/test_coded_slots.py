"""Residual-coded slots: the slots' memory holds residual blobs, rebuilt per verify wave; lossless, more experts."""
import pytest
import torch

import specter
from specter.errors import SpecterError
from specter.offload.coded_slots import SCRATCH_ROWS, CodedSlots, coded_rows
from specter.offload.residual_store import ResidualExpertStore, kernel_check_experts
from specter.offload.runtime import move_experts_to_store
from specter.offload.streams import DeviceStreams
from tests.conftest import TINY_MODELS, prompt
from tests.test_default_config import hf_greedy_in

NEW = 24
CODED = dict(resident_experts_per_layer=6, coded_slots=True)


def test_coded_rows_fill_the_same_memory_less_the_scratch_rows():
    # 26 layers x 4 slots + 56 spare rows of 1000-byte experts, 540-byte rows, less 8 scratch rows: 281 rows
    assert coded_rows(4, 56, 26, 64, 1000, 540) == (7, 281 - 26 * 7, SCRATCH_ROWS)
    assert coded_rows(30, 4, 2, 8, 1000, 540) == (8, 103 - 16, SCRATCH_ROWS)  # capped at the experts of a layer
    assert coded_rows(1, 4, 3, 8, 1000, 700) == (1, 1, 4)  # fewer scratch rows, so that each layer keeps one
    with pytest.raises(SpecterError, match="coded slots need the memory of at least 3.1 16-bit experts"):
        coded_rows(1, 0, 3, 8, 1000, 700)


def test_coded_slots_switch_themselves_off_with_a_reason():
    model = specter.load_model("tiny-qwen", device="cpu", dtype=torch.bfloat16)

    def state(**fields):
        engine = specter.SpecterEngine(model, specter.SpecterConfig(**fields))
        return engine.mechanisms["coded_slots"], engine.config.coded_slots

    assert state(resident_experts_per_layer=6) == ("on", True)  # the default
    assert state(resident_experts_per_layer=6, coded_slots=False) == ("off: not asked", False)
    assert state(coded_slots=True) == ("off: every expert resident on the device (nothing is loaded)", False)
    assert state(**CODED, residual_transfer=False) == (
        "off: needs residual transfer (residual_transfer off: not asked)", False)
    fp32 = specter.load_model("tiny-qwen", device="cpu", dtype=torch.float32)
    assert specter.SpecterEngine(fp32, specter.SpecterConfig(**CODED)).mechanisms["coded_slots"].startswith(
        "off: needs residual transfer (residual_transfer off: residual_transfer needs 16-bit experts")


@pytest.mark.parametrize("name", TINY_MODELS)
def test_coded_slots_equal_hf_greedy_with_more_experts_and_fewer_bytes(name):
    """bf16 (residual transfer runs; on the CPU the rebuild is the torch reference): HF's greedy tokens; against the
    same memory as 16-bit slots, more experts per layer, a higher hit rate and fewer bytes."""
    model = specter.load_model(name, device="cpu", dtype=torch.bfloat16)
    ids = prompt("Natalia sold clips")
    coded = specter.SpecterEngine(model, specter.SpecterConfig(**CODED, k=4)).generate(ids, NEW)
    plain = specter.SpecterEngine(model, specter.SpecterConfig(resident_experts_per_layer=6, k=4, coded_slots=False)
                                  ).generate(ids, NEW)
    assert coded.token_ids == plain.token_ids == hf_greedy_in(name, torch.bfloat16, ids, NEW), name
    assert coded.stats["mechanisms"]["coded_slots"] == "on"
    assert coded.stats["resident_experts_per_layer"] > plain.stats["resident_experts_per_layer"]
    assert coded.stats["hit_rate"] > plain.stats["hit_rate"]
    assert coded.stats["h2d_bytes"] < plain.stats["h2d_bytes"]


def test_token_wise_verification_reads_coded_slots_too():
    model = specter.load_model("tiny-dsv2", device="cpu", dtype=torch.bfloat16)
    ids = prompt("def f(x):")
    out = specter.SpecterEngine(model, specter.SpecterConfig(**CODED, k=4, expert_wise=False)).generate(ids, 12)
    assert out.token_ids == hf_greedy_in("tiny-dsv2", torch.bfloat16, ids, 12)


def test_a_batch_of_32_with_coded_slots_gives_each_requests_greedy_tokens():
    model = specter.load_model("tiny-qwen", device="cpu", dtype=torch.bfloat16)
    texts = ["Natalia sold clips", "def f(x):", "The tower is", "Robert Boulter is"]
    prompts = [prompt(f"{texts[i % 4]} {i}").tolist()[0] for i in range(32)]
    batch = specter.SpecterEngine(model, specter.SpecterConfig(**CODED)).generate(prompts, 8)
    reference = specter.SpecterEngine(model, specter.SpecterConfig.paper(resident_experts_per_layer=6))
    assert [r.token_ids for r in batch] == [r.token_ids for r in reference.generate(prompts, 8)]
    assert batch[0].stats["mechanisms"]["coded_slots"] == "on"


def test_a_rebuild_gives_each_waves_exact_experts_in_scratch_rows_in_order():
    model = specter.load_model("tiny-mixtral", device="cpu", dtype=torch.bfloat16)
    store = move_experts_to_store(model, keep_on_device=True)
    residuals = ResidualExpertStore.build(store, model.experts)
    coded = CodedSlots(residuals, 4, SCRATCH_ROWS, store.numel, store.dtype, torch.device("cpu"))
    streams = DeviceStreams(torch.device("cpu"))
    for row, expert in enumerate((5, 2, 7)):
        coded.copy_in(streams, row, 1, expert)
    assert coded.rebuild(streams, 1, [(7, 2), (5, 0)]) == [0, 1]
    assert torch.equal(coded.scratch[0], store.expert(1, 7)) and torch.equal(coded.scratch[1], store.expert(1, 5))
    with pytest.raises(ValueError, match="exceeds the 8 scratch rows"):
        coded.rebuild(streams, 1, [(2, 1)] * (SCRATCH_ROWS + 1))
    coded.free()  # the buffers go, not just their views
    assert coded.blobs.untyped_storage().nbytes() == coded.scratch.untyped_storage().nbytes() == 0


def test_the_store_refuses_a_decode_kernel_that_does_not_rebuild_its_experts(monkeypatch):
    """Where the kernel decodes (CUDA), the store checks two experts at build; here the kernel is stood in for by the
    reference decode, then by one that flips a bit of the last expert."""
    model = specter.load_model("tiny-qwen", device="cpu", dtype=torch.bfloat16)
    store = move_experts_to_store(model, keep_on_device=True)
    residuals = ResidualExpertStore.build(store, model.experts)
    assert not residuals.use_kernel  # no-op on the CPU
    residuals.use_kernel = True
    monkeypatch.setattr(residuals, "launcher", lambda: None)  # decode falls back to the reference
    expected = kernel_check_experts(store)
    residuals.check_kernel(expected)
    exact = residuals.decode
    last = (len(residuals.drafts) - 1, store.num_experts - 1)

    def flipped(layer, expert, launcher, blob, out):
        exact(layer, expert, launcher, blob, out)
        if (layer, expert) == last:
            out.view(torch.int16)[17] ^= 1
        return out

    monkeypatch.setattr(residuals, "decode", flipped)
    with pytest.raises(SpecterError, match=f"does not rebuild layer {last[0]}'s expert {last[1]} bit for bit"):
        residuals.check_kernel(expected)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-qwen", "tiny-mixtral"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_coded_slots_on_cuda_give_the_16_bit_slots_tokens_with_fewer_bytes(name, dtype):
    """The CUDA path (blob copies on the copy stream, one decode launch per wave on the compute stream) against 16-bit
    slots in the same memory and raw copies. (The resident target is not the reference here: in bf16 tiny-mixtral's
    offloaded slot kernel and its resident experts round apart after 10 tokens, with or without coded slots.)"""
    model = specter.load_model(name, device="cuda", dtype=dtype)
    ids = prompt("Natalia sold clips")
    runs = [specter.SpecterEngine(model, specter.SpecterConfig(resident_experts_per_layer=6, k=4, **fields))
            .generate(ids, NEW) for fields in ({}, {"coded_slots": False}, {"residual_transfer": False})]
    coded, plain, raw = runs
    assert coded.token_ids == plain.token_ids == raw.token_ids, name
    assert coded.stats["mechanisms"]["coded_slots"] == "on" and coded.stats["h2d_bytes"] < plain.stats["h2d_bytes"]
    assert coded.stats["residual_decodes"] > 0  # the rebuilds
