"""Draft files and the quantize_draft CLI: save/load of a GPTQ draft, corrupt and mismatched files, the CLI."""
import dataclasses
import json

import pytest
import torch
from transformers import DynamicCache

import specter
from initialization import quantize_draft
from specter.errors import SpecterError
from specter.models.hybrid import hybridize
from specter.models.loading import build_synthetic
from specter.models.registry import get_spec
from specter.models.tokenizer import ByteTokenizer
from specter.quant.draft_io import MANIFEST_FILE, WEIGHTS_FILE, load_draft, save_draft
from specter.quant.gptq import quantize_experts_gptq
from specter.quant.int4 import quantize_rtn
from tests.test_gptq import CALIBRATION, draft_buffers, fresh, token_ids


@pytest.fixture(scope="module")
def gptq_model():
    """A fresh tiny-qwen with a GPTQ draft calibrated on the built-in calibration texts."""
    model = fresh()
    quantize_experts_gptq(model, token_ids(model))
    return model


# (c) save / load


def test_save_load_round_trip(gptq_model, tmp_path):
    model = gptq_model
    save_draft(model, tmp_path / "d", extra={"note": "test"})
    manifest = json.loads((tmp_path / "d" / MANIFEST_FILE).read_text())
    assert manifest["quantizer"] == "gptq" and manifest["group_size"] == 128 and manifest["model"] == "tiny-qwen"
    assert manifest["num_layers"] == 3 and manifest["num_experts"] == 8
    assert manifest["shapes"]["experts.0.gate_up.qweight"] == [8, 16, 512]
    other = fresh()
    assert other.quantizer == "rtn"
    load_draft(other, tmp_path / "d")
    assert other.quantizer == "gptq"
    ours, theirs = draft_buffers(model), draft_buffers(other)
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]) and ours[k].dtype == theirs[k].dtype, k
    x = token_ids(model)[0]
    torch.testing.assert_close(other.forward(x, DynamicCache(config=other.hf.config), mode="draft"),
                               model.forward(x, DynamicCache(config=model.hf.config), mode="draft"), rtol=0, atol=0)
    with pytest.raises(SpecterError, match="already holds a draft"):
        save_draft(model, tmp_path / "d")


def test_load_rejects_corrupt_missing_and_mismatched(gptq_model, tmp_path):
    model = gptq_model
    good = save_draft(model, tmp_path / "good")
    target = fresh()
    before = draft_buffers(target)

    corrupt = save_draft(model, tmp_path / "corrupt")
    data = bytearray((corrupt / WEIGHTS_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (corrupt / WEIGHTS_FILE).write_bytes(bytes(data))
    with pytest.raises(SpecterError, match="corrupt") as info:
        load_draft(target, corrupt)
    assert "\n" not in str(info.value)

    bad_json = save_draft(model, tmp_path / "bad_json")
    (bad_json / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(SpecterError, match="JSON"):
        load_draft(target, bad_json)

    edited = save_draft(model, tmp_path / "edited")
    manifest = json.loads((edited / MANIFEST_FILE).read_text())
    manifest["shapes"]["experts.1.down.scales"] = [8, 1, 128]
    (edited / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(SpecterError, match="shape"):
        load_draft(target, edited)

    with pytest.raises(SpecterError, match="does not exist"):
        load_draft(target, tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecterError, match="missing"):
        load_draft(target, tmp_path / "empty")
    no_weights = save_draft(model, tmp_path / "no_weights")
    (no_weights / WEIGHTS_FILE).unlink()
    with pytest.raises(SpecterError, match="missing"):
        load_draft(target, no_weights)

    # a model of the same architecture with another expert size: shape mismatch
    spec = get_spec("tiny-qwen")
    spec = dataclasses.replace(spec, hf_config={**spec.hf_config, "moe_intermediate_size": 384})
    wider = hybridize(build_synthetic(spec, torch.device("cpu"), torch.float32, 0), spec, ByteTokenizer())
    with pytest.raises(SpecterError, match="intermediate_size|shape"):
        load_draft(wider, good)
    # another architecture
    with pytest.raises(SpecterError, match="qwen2_moe"):
        load_draft(fresh("tiny-mixtral"), good)
    # same shapes, other target weights (another seed)
    with pytest.raises(SpecterError, match="different target weights"):
        load_draft(fresh(seed=1), good)

    after = draft_buffers(target)  # failed loads leave the model untouched
    assert all(torch.equal(before[k], after[k]) for k in before) and target.quantizer == "rtn"


# (d) the CLI


def test_cli_writes_a_draft_and_refuses_to_overwrite(tmp_path, capsys):
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"question": q}) + "\n" for q in CALIBRATION))
    out = tmp_path / "draft"
    argv = ["--model", "tiny-qwen", "--output", str(out), "--calibration", "gsm8k", "--calibration-file", str(calib),
            "--num-prompts", "3", "--tokens", "48", "--device", "cpu"]
    assert quantize_draft.main(argv) == 0
    printed = capsys.readouterr().out
    assert "GPTQ" in printed and "RTN fallback" in printed
    assert (out / WEIGHTS_FILE).is_file() and (out / MANIFEST_FILE).is_file()
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert manifest["quantizer"] == "gptq"
    report = manifest["extra"]["report"]
    assert report["num_prompts"] == 3 and report["calibration_tokens"] == 3 * 48
    model = fresh()
    load_draft(model, out)
    assert model.quantizer == "gptq"

    assert quantize_draft.main(argv) == 2  # existing non-empty output directory
    err = capsys.readouterr().err.strip()
    assert "not empty" in err and len(err.splitlines()) == 1


def test_cli_errors_are_one_line(tmp_path, capsys):
    out = tmp_path / "draft"
    code = quantize_draft.main(["--model", "tiny", "--output", str(out), "--calibration", "text",
                                "--calibration-file", str(tmp_path / "missing.txt")])
    assert code == 2 and not out.exists()
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "not found" in err and len(err.splitlines()) == 1
    assert quantize_draft.main(["--model", "no-such-model", "--output", str(out)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_cli_text_windows_and_rtn(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text(" ".join(CALIBRATION * 3))
    model = fresh("tiny")
    ids = quantize_draft.calibration_ids(model, text.read_text(), num_prompts=4, tokens=32, seed=0)
    assert len(ids) == 4 and all(x.shape == (1, 32) for x in ids)
    assert quantize_draft.main(["--model", "tiny", "--output", str(tmp_path / "rtn"), "--method", "rtn"]) == 0
    assert json.loads((tmp_path / "rtn" / MANIFEST_FILE).read_text())["quantizer"] == "rtn"
    load_draft(model, tmp_path / "rtn")
    rtn = quantize_rtn(model.experts[0].gate_up_proj.detach())
    assert torch.equal(model.experts[0].draft_gate_up_qweight, rtn.qweight)


def test_load_model_installs_a_saved_draft(tmp_path):
    """load_model(..., draft=DIR) gives the saved GPTQ draft, and decoding stays lossless."""
    from tests.conftest import hf_greedy, prompt

    source = specter.load_model("tiny-qwen", device="cpu")
    quantize_experts_gptq(source, [prompt("Natalia sold clips to 48 of her friends in April")])
    save_draft(source, tmp_path / "draft")
    model = specter.load_model("tiny-qwen", device="cpu", draft=tmp_path / "draft")
    assert model.quantizer == "gptq"
    assert torch.equal(model.experts[1].draft_down_qweight, source.experts[1].draft_down_qweight)
    out = specter.SpecterEngine(model, specter.SpecterConfig(k=4, resident_experts_per_layer=2)).generate(prompt(), 16)
    assert out.token_ids == hf_greedy("tiny-qwen", prompt(), 16)
