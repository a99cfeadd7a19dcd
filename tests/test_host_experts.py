"""Experts built straight into host memory where the GPU cannot hold the whole build (library, CLI and harness
alike, stated in run.json), the device never holding more than one layer's experts while building, and the host
memory an offloaded run keeps checked before anything loads."""
import json

import pytest
import torch

import specter
import specter.models.loading as loading
from experiments.main import run
from specter.errors import SpecterError
from specter.models.loading import hf_config, with_layers
from specter.models.memory_check import GB, check_host_memory, experts_placement, host_need
from specter.models.registry import get_spec
from tests.cli import compose_with
from tests.live_bytes import LiveBytes

PHI = get_spec("phi")


def test_phi_and_mixtral_on_an_80_gb_gpu_put_their_experts_on_the_host_and_dsv2_does_not():
    free = 78 * GB
    for name, on_host in (("phi", True), ("mixtral", True), ("dsv2", False), ("qwen", False)):
        spec = get_spec(name)
        placed, why = experts_placement(spec, hf_config(spec), torch.device("cuda"), torch.bfloat16, gpu_free=free)
        assert placed == on_host, (name, why)
        assert ("pinned host memory" in why) == on_host and "78.0 GB is free" in why or not on_host
    placed, why = experts_placement(PHI, hf_config(PHI), torch.device("cpu"), torch.bfloat16)
    assert not placed and "runs on the cpu" in why


def test_the_library_places_the_experts_as_the_rule_says(monkeypatch):
    monkeypatch.setattr(loading, "experts_placement", lambda *args, **kwargs: (True, "as if the GPU were small"))
    model = specter.load_model("tiny-qwen", device="cpu", dtype=torch.bfloat16)
    assert model.host_store is not None  # built straight into the host store
    out = specter.SpecterEngine(model, specter.SpecterConfig(resident_experts_per_layer=3)).generate(
        torch.tensor([[256, *b"Natalia"]]), 8)
    assert len(out.token_ids) == 8
    assert specter.load_model("tiny-qwen", device="cpu", experts_on_host=False).host_store is None  # asked: kept


def test_building_with_host_experts_holds_one_layer_of_experts_outside_the_store_at_a_time():
    """tiny-qwen rebuilt with 12 layers: every byte the build keeps beyond the host store, the non-expert
    weights and the INT4 drafts is one layer's experts and their generation's and quantization's temporaries."""
    spec = with_layers(get_spec("tiny-qwen"), 12)
    with LiveBytes() as live:
        model = specter.load_model("tiny-qwen", device="cpu", dtype=torch.bfloat16, experts_on_host=True,
                                   num_layers=12)
    store = model.host_store
    store_bytes = sum(buffer.numel() * buffer.element_size() for buffer in store.buffers)
    layer_experts = store_bytes // 12
    rest = sum(t.numel() * t.element_size() for t in model.hf.parameters()) + \
        sum(t.numel() * t.element_size() for m in model.experts for t in m.buffers())
    assert spec.hf_config["num_hidden_layers"] == 12
    # one layer generated, quantized (float32 temporaries) and copied: under 5 layers' bytes; 12 at once: 12 more
    assert live.peak <= store_bytes + rest + 5 * layer_experts
    assert live.peak > store_bytes  # it did see the store


def test_an_offloaded_run_that_cannot_keep_its_host_memory_is_one_line_before_loading():
    config = hf_config(get_spec("mixtral"))
    need = host_need(get_spec("mixtral"), config, torch.bfloat16, residual=True)
    assert need["residual blobs"] < need["FP experts"] and sum(need.values()) / GB > 140
    with pytest.raises(SpecterError) as info:
        check_host_memory(get_spec("mixtral"), config, torch.bfloat16, residual=True, keep_raw=True,
                          host_free=125 * GB)
    message = str(info.value)
    assert "\n" not in message and "125.0 GB is available" in message and "residual blobs" in message
    check_host_memory(get_spec("dsv2"), hf_config(get_spec("dsv2")), torch.bfloat16, True, host_free=125 * GB)
    assert "systems=[specter] alone keeps the blobs" in message


def test_the_harness_refuses_a_host_it_does_not_fit_and_says_where_the_experts_went(tmp_path, monkeypatch):
    import specter.models.memory_check as memory_check
    monkeypatch.chdir(tmp_path)
    fast = ("num_prompts=1", "repeats=1", "max_new_tokens=4", "device=cpu", "dataset=builtin",
            "systems=[specter]", f"results_root={tmp_path}")
    out = run(compose_with(*fast))
    assert json.loads((out / "run.json").read_text())["experts"]["on"] == "device"
    info = json.loads((out / "run.json").read_text())
    assert info["invocations"][-1]["peak_memory"]["host_gb"] > 0
    monkeypatch.setattr(memory_check, "available_host_bytes", lambda: 1000)
    with pytest.raises(SpecterError, match="keeps about .* GB in host memory"):
        run(compose_with(*fast, "results_dir=" + str(tmp_path / "second")))


def test_specter_alone_keeps_the_residual_blobs_and_not_the_raw_experts():
    """keep_raw_experts=False: each layer's raw experts leave the host store once encoded; the tokens are the
    raw-keeping engine's; a system that reads raw experts then stops with one line."""
    from baselines.target_only import TargetOnly
    ids = torch.tensor([[256, *b"Natalia sold clips"]])
    config = specter.SpecterConfig(resident_experts_per_layer=3)
    kept = specter.load_model("tiny-qwen", device="cpu", dtype=torch.bfloat16)
    with LiveBytes() as with_raw:
        expected = specter.SpecterEngine(kept, config).generate(ids, 16).token_ids
    model = specter.load_model("tiny-qwen", device="cpu", dtype=torch.bfloat16)
    with LiveBytes() as blobs_only:
        engine = specter.SpecterEngine(model, config, keep_raw_experts=False)
        assert engine.generate(ids, 16).token_ids == expected
    store = model.host_store
    assert not store.holds_raw and all(buffer is None for buffer in store.buffers)
    assert kept.host_store.holds_raw  # the default keeps them
    assert with_raw.now - blobs_only.now >= 0.95 * store.total_bytes  # what stays alive: less the raw experts
    with pytest.raises(SpecterError, match="raw experts were released: this model keeps only residual blobs"):
        TargetOnly(model, 3).generate(ids, 4)


def test_the_host_check_counts_a_layer_of_blobs_where_the_raw_experts_go_as_encoded():
    spec, config = get_spec("mixtral"), hf_config(get_spec("mixtral"))
    both = sum(host_need(spec, config, torch.bfloat16, residual=True).values())
    alone = sum(host_need(spec, config, torch.bfloat16, residual=True, keep_raw=False).values())
    raw = host_need(spec, config, torch.bfloat16, residual=False)["FP experts"]
    assert alone < raw * 1.2 < both
    check_host_memory(spec, config, torch.bfloat16, residual=True, keep_raw=False, host_free=125 * GB)


def test_the_harness_lets_the_raw_experts_go_only_when_every_system_reads_blobs():
    from experiments.run_model import keep_raw_experts
    config = specter.SpecterConfig(resident_experts_per_layer=3)
    assert not keep_raw_experts(["specter"], config)
    assert keep_raw_experts(["specter", "mo_sm"], config) and keep_raw_experts(["specter_paper"], config)
    assert keep_raw_experts(["specter"], specter.SpecterConfig(residual_transfer=False))


def test_a_host_that_cannot_hold_both_forms_measures_the_systems_one_after_another(tmp_path, monkeypatch, capsys):
    """As if the host could not hold the raw experts and their blobs at once: target-only and MO-SM (raw) run
    every case first, then the raw experts go as they are encoded and Specter (blobs) runs; Specter's tokens are
    still checked against target-only's (replayed from the blobs), and the header and run.json say so."""
    import pandas as pd
    import experiments.run_model as settings
    monkeypatch.setattr(settings, "available_host_bytes", lambda: 1)  # both forms never fit: phases
    monkeypatch.chdir(tmp_path)
    out = run(compose_with("systems=[specter,target_only,mo_sm]", "dtype=bfloat16", "num_prompts=1", "repeats=1",
                           "max_new_tokens=8", "device=cpu", "dataset=builtin", f"results_root={tmp_path}"))
    rows = pd.read_csv(out / "records.csv")
    assert list(rows.system) == ["target_only", "mo_sm", "specter"]  # phase 1, then phase 2
    assert (rows.status == "ok").all()
    specter_row = rows[rows.system == "specter"].iloc[0]
    assert specter_row.tokens_match_target == "yes" and specter_row.token_check == "equal"
    assert "residual_transfer" in specter_row.mechanisms
    info = json.loads((out / "run.json").read_text())
    assert "measured one after another" in info["experts"]["raw"]
    assert "measured one after another, target_only+mo_sm then specter" in capsys.readouterr().out


def test_a_phased_run_cut_after_its_first_phase_resumes_with_its_tokens_checked(tmp_path, monkeypatch):
    """A run cut after its raw readers finished: resumed, it runs only the blob readers, whose tokens are checked
    against target-only's replayed from the blobs (the earlier invocation's tokens are not in records.csv)."""
    import pandas as pd
    import experiments.run_model as settings
    monkeypatch.setattr(settings, "available_host_bytes", lambda: 1)
    monkeypatch.chdir(tmp_path)
    args = ("systems=[specter,target_only,mo_sm]", "dtype=bfloat16", "num_prompts=1", "repeats=1",
            "max_new_tokens=8", "device=cpu", "dataset=builtin", f"results_dir={tmp_path / 'run'}")
    out = run(compose_with(*args))
    rows = pd.read_csv(out / "records.csv")
    rows[rows.system != "specter"].to_csv(out / "records.csv", index=False)  # as if cut during phase 2
    info = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({**info, "complete": False}))
    run(compose_with(*args, "resume=true"))
    resumed = pd.read_csv(out / "records.csv")
    assert list(resumed.system) == ["target_only", "mo_sm", "specter"]
    specter_row = resumed[resumed.system == "specter"].iloc[0]
    assert specter_row.token_check == "equal" and specter_row.invocation == 1


def test_a_host_build_for_specter_alone_never_holds_the_raw_experts(monkeypatch):
    """load_model(keep_raw_experts=False) with experts on the host: each layer is encoded on the device as it is
    built, so the host store never takes a raw layer and the build's live bytes peak well below the raw-keeping
    build's; Specter's tokens equal those of the same build keeping its raw experts; the host and build checks
    count the blobs alone."""
    import specter.offload.residual_store as residual_store
    from specter.offload.host_store import HostExpertStore
    ids = torch.tensor([[256, *b"Natalia sold clips"]])
    config = specter.SpecterConfig(resident_experts_per_layer=3)
    build = dict(device="cpu", dtype=torch.bfloat16, experts_on_host=True, num_layers=12)
    with LiveBytes() as raw_build:
        kept = specter.load_model("tiny-qwen", **build)
    expected = specter.SpecterEngine(kept, config).generate(ids, 16).token_ids
    raw_bytes = kept.host_store.total_bytes
    float32 = specter.load_model("tiny-qwen", device="cpu", dtype=torch.float32, experts_on_host=True,
                                 keep_raw_experts=False)
    assert float32.residual_store is None and float32.host_store.holds_raw  # no residual transfer: raw kept
    monkeypatch.setattr(residual_store, "ENCODE_WORK_BYTES", raw_bytes // 48)  # a bounded encode, as at full size

    def no_raw(*args):
        raise AssertionError("a raw layer went to the host store")

    monkeypatch.setattr(HostExpertStore, "put_layer", no_raw)
    with LiveBytes() as encoded_build:
        model = specter.load_model("tiny-qwen", **build, keep_raw_experts=False)
    assert all(buffer is None for buffer in model.host_store.buffers) and not model.host_store.holds_raw
    assert model.residual_store is not None
    assert encoded_build.peak < raw_build.peak - 0.25 * raw_bytes  # blobs (about 0.6 of raw) and one layer
    engine = specter.SpecterEngine(model, config, keep_raw_experts=False)
    assert "residual_transfer" in [m for m, state in engine.mechanisms.items() if state == "on"]
    assert engine.generate(ids, 16).token_ids == expected
    spec, hf = get_spec("mixtral"), hf_config(get_spec("mixtral"))
    encoded = sum(host_need(spec, hf, torch.bfloat16, residual=True, keep_raw=False, encoded=True).values())
    raw = host_need(spec, hf, torch.bfloat16, residual=False)["FP experts"]
    assert encoded < 0.9 * raw
    check_host_memory(spec, hf, torch.bfloat16, residual=True, keep_raw=False, encoded=True, host_free=int(0.9 * raw))
    with pytest.raises(SpecterError, match="keeps about"):
        check_host_memory(spec, hf, torch.bfloat16, residual=True, keep_raw=False, host_free=int(0.9 * raw))
