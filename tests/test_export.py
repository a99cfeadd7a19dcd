"""The exported plain HF model and checkpoint hold exactly the target's weights (baselines start from them)."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

import specter
from baselines.export import plain_hf_model, save_checkpoint, target_tensors
from specter.offload.runtime import offload_experts
from tests.conftest import hf_greedy, pristine_hf, prompt


def test_plain_model_has_the_pristine_weights_and_no_draft(tiny_name):
    model = specter.load_model(tiny_name, device="cpu", dtype=torch.float32)
    assert not any("draft" in name for name in target_tensors(model))
    exported = plain_hf_model(model).state_dict()
    pristine = pristine_hf(tiny_name).state_dict()
    assert exported.keys() == pristine.keys()
    assert all(torch.equal(exported[k], pristine[k]) for k in pristine)


@pytest.mark.parametrize("name", ["tiny-qwen", "tiny-dsv2"])
def test_checkpoint_of_an_offloaded_model_decodes_like_hf(tmp_path, name):
    model = specter.load_model(name, device="cpu", dtype=torch.float32)
    offload_experts(model, 1)  # experts now live only in the host store
    save_checkpoint(model, tmp_path)
    assert json.loads((tmp_path / "specter_tokenizer.json").read_text())["type"] == "ByteTokenizer"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = prompt()
    out = loaded.generate(ids, max_new_tokens=10, do_sample=False)
    assert out[0, ids.shape[1]:].tolist() == hf_greedy(name, ids, 10)


def test_export_after_a_decode_of_a_longrope_model(tmp_path):
    """After a forward of HF's own longrope rotary, inv_freq and original_inv_freq are one tensor: both names
    still export."""
    model = specter.load_model("tiny-phi", device="cpu", dtype=torch.float32, seed=3)
    assert model.hf.config.rope_parameters["rope_type"] == "longrope"
    tokens = specter.SpecterEngine(model, specter.SpecterConfig(k=4)).generate(prompt(), 8).token_ids
    rotary = model.hf.model.rotary_emb
    type(rotary).forward(rotary, torch.zeros(1, 1), position_ids=torch.arange(4)[None])  # HF's forward, not ours
    assert rotary.inv_freq is rotary.original_inv_freq  # the state that broke the export
    save_checkpoint(model, tmp_path)
    again = specter.load_model(tmp_path, device="cpu", dtype=torch.float32)  # byte ids recorded by the export
    assert specter.SpecterEngine(again, specter.SpecterConfig(k=4)).generate(prompt(), 8).token_ids == tokens
