"""The main job and its configs: every option composes; the CLI writes results and refuses to overwrite."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

from experiments.machine import busy_warning, host_op_us, load_note, machine_state
from experiments.main import checkpoint_overrides, token_cap_overrides
from experiments.run_dirs import results_dir
from experiments.settings import check_run_settings, model_choice, specter_config, workload
from experiments.summarize import main as summarize_main
from experiments.summarize import summarize_dir
from experiments.systems import build_system, known_systems
from specter.errors import SpecterError
from tests.cli import cli_error, compose_with
from tests.conftest import pristine_hf, tiny_model

ROOT = Path(__file__).resolve().parent.parent
EXTERNAL_ENGINES = {"vllm", "llama_cpp"}
CONF = ROOT / "conf"


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("model", options("model"))
@pytest.mark.parametrize("mem", options("mem"))
def test_every_model_and_mem_option_composes(model, mem):
    weights = [] if model.startswith("tiny") else ["model.weights=synthetic"]  # no checkpoints here
    cfg = compose_with(f"model={model}", f"mem={mem}", *weights)  # mem=gb: 40 GB, enough for every model
    choice = model_choice(cfg)
    config = specter_config(cfg, choice.spec)
    assert config.k == choice.spec.depth_k.get(cfg.mem.preset, choice.spec.default_k)
    if mem in choice.spec.mem_presets:
        assert config.resident_experts_per_layer == choice.spec.mem_presets[mem]
    else:  # a GB budget
        assert 1 <= config.resident_experts_per_layer <= choice.spec.num_experts


@pytest.mark.parametrize("system", known_systems())
def test_every_system_option_instantiates(system):
    cfg = compose_with()
    model = tiny_model("tiny")
    built = build_system(system, model, specter_config(cfg, model.spec))
    ok, reason = built.available()
    assert built.name == system
    if system in EXTERNAL_ENGINES:  # they cannot run tiny-dsv2 (see their tests): they must say why
        assert ok or reason.strip()
    else:
        assert (ok, reason) == (True, "")
    if system == "specter":  # the tiny default is float32: residual transfer switches itself off and says why
        assert built.mechanisms["residual_transfer"] == ("off: residual_transfer needs 16-bit experts (float16 or "
                                                         "bfloat16); this model's are float32")


@pytest.mark.parametrize("override", ["++token_caps={transformers:16}", "++token_caps.transformers=16"])
def test_token_caps_override_from_the_command_line(override):
    cfg = compose_with(override)
    assert cfg.token_caps.transformers == 16 and "specter" not in cfg.token_caps


@pytest.mark.parametrize("system", known_systems())
def test_every_system_can_be_capped_without_a_list_of_systems(system, tmp_path, monkeypatch):
    assert token_cap_overrides([f"token_caps.{system}=4", "k=2"]) == [f"++token_caps.{system}=4", "k=2"]
    check_run_settings(compose_with(f"++token_caps.{system}=4"))
    with pytest.raises(SpecterError, match="token_caps.nope: unknown system 'nope'"):
        check_run_settings(compose_with("++token_caps.nope=4"))


# A valid value other than the default for every option of the `specter` group (a new SpecterConfig field
# needs one here, which makes it reachable from the command line or derived on purpose).
def run_main(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.main", *args], cwd=cwd, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
                          timeout=300)


def test_main_writes_tables_and_never_overwrites(tmp_path):
    out = tmp_path / "run"
    args = (f"results_dir={out}", "num_prompts=2", "repeats=1", "max_new_tokens=12", "strict=true", "device=cpu")
    first = run_main(*args, cwd=ROOT)
    assert first.returncode == 0, first.stderr
    assert {p.name for p in out.iterdir()} == {"records.csv", "summary.csv", "run.json"}
    records = pd.read_csv(out / "records.csv")
    assert set(records.system) == {"specter", "specter_paper", "target_only"} and len(records) == 6
    assert (records[records.system == "specter"].tokens_match_target == "yes").all()
    assert "same tokens" in first.stdout and "specter" in first.stdout
    before = (out / "records.csv").read_bytes()
    second = run_main(*args, cwd=ROOT)
    assert second.returncode == 2
    assert second.stderr.strip().count("\n") == 0 and "already exists" in second.stderr
    assert (out / "records.csv").read_bytes() == before


def test_default_results_dir_gets_a_new_suffix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = compose_with()
    first, resumed = results_dir(cfg)
    assert first == Path("results/main/tiny-dsv2-high") and not resumed
    first.mkdir(parents=True)
    assert results_dir(cfg) == (Path("results/main/tiny-dsv2-high.1"), False)
    assert results_dir(compose_with("resume=true")) == (first, True)


@pytest.mark.parametrize("override,message", [
    ("num_prompts=-2", "num_prompts must be an integer >= 1, got -2"),
    ("repeats=0", "repeats must be an integer >= 1, got 0"),
    ("max_new_tokens=0", "max_new_tokens must be an integer >= 1, got 0"),
    ("k=2.5", "k must be an integer >= 1, null or auto, got 2.5"),
    ("k=abc", "k must be an integer >= 1, null or auto, got 'abc'"),
    ("k=true", "k must be an integer >= 1, null or auto, got True"),
    ("systems=[]", "systems must be a non-empty list"),
    ("temperature=nan", "temperature must be a finite number >= 0, got nan"),
    ("temperature=-1", "temperature must be a finite number >= 0, got -1"),
    ("warmup_tokens=-1", "warmup_tokens must be an integer >= 0 or null, got -1"),
    ("++token_caps.transformers=0", "token_caps.transformers must be an integer >= 1 or null, got 0"),
    ("+experiment.k_values=[2,0]", "each of experiment.k_values must be an integer >= 1, got 0"),
    ("seed=1.5", "seed must be an integer, got 1.5"),
])
def test_nonsense_run_settings_are_refused_before_anything_loads(override, message):
    with pytest.raises(SpecterError, match=re.escape(message)):
        check_run_settings(compose_with(override))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_a_one_line_error():
    with pytest.raises(SpecterError, match="device=cuda but this machine has no usable CUDA GPU"):
        check_run_settings(compose_with("device=cuda"))


def test_the_default_run_settings_pass():
    check_run_settings(compose_with())
    check_run_settings(compose_with("k=auto", "experiment=depth"))


def test_a_busy_machine_is_named_in_a_warning_and_the_header():
    assert busy_warning({"load_average_1min": 0.3, "cpu_cores": 2}) is None
    warning = busy_warning({"load_average_1min": 1.9, "cpu_cores": 2})
    assert warning.startswith("warning: this machine was busy when the run started (host load 1.9/2 cores)")
    assert load_note({"load_average_1min": 1.9, "cpu_cores": 2}) == ", host load 1.9/2 cores"
    assert load_note({"load_average_1min": 1.9, "cpu_cores": 2, "host_op_us": 3.6}) == \
        ", host load 1.9/2 cores, 3.6 us per host op"
    state = machine_state()
    assert state["cpu_cores"] >= 1 and state["load_average_1min"] >= 0 and state["host_op_us"] > 0
    assert host_op_us(torch.device("cpu"), ops=10, rounds=2) > 0


def test_a_run_resumes_only_into_a_directory_of_the_same_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = Path("results/main/tiny-dsv2-high")
    out.mkdir(parents=True)
    (out / "run.json").write_text(json.dumps({"config": OmegaConf.to_container(compose_with(), resolve=True)}))
    assert results_dir(compose_with("resume=true")) == (out, True)
    with pytest.raises(SpecterError, match=r"another config: max_new_tokens \(128 there, 32 now\);"):
        results_dir(compose_with("resume=true", "max_new_tokens=32"))
    with pytest.raises(SpecterError, match=r"model.name \('tiny' there, 'tiny-qwen' now\)"):
        results_dir(compose_with("resume=true", "model=tiny-qwen", f"results_dir={out}"))
    assert results_dir(compose_with("resume=force", "max_new_tokens=32")) == (out, True)
    older = OmegaConf.to_container(compose_with(), resolve=True)  # a run from before two options existed
    del older["specter"]["pooled_slots"]
    (out / "run.json").write_text(json.dumps({"config": older}))
    assert results_dir(compose_with("resume=true")) == (out, True)  # the new options at their defaults
    with pytest.raises(SpecterError, match=r"specter.pooled_slots \(None there, 1 now\)"):
        results_dir(compose_with("resume=true", "specter.pooled_slots=1"))
    (out / "run.json").write_text("{")  # torn
    with pytest.raises(SpecterError, match="run.json is missing or unreadable"):
        results_dir(compose_with("resume=true"))
    with pytest.raises(SpecterError, match="resume must be true, false or force"):
        results_dir(compose_with("resume=maybe"))


@pytest.mark.parametrize("args,message", [
    (("model=nope",), "unknown model 'nope'"),
    (("k=0",), "k must be an integer >= 1"),
    (("specter.top_p=0",), "top_p must be a number in (0, 1], got 0"),
    (("model=dsv2",), "no checkpoint for 'dsv2'"),
    (("model=dsv2", "model.checkpoint=/nonexistent/dsv2"), "checkpoint path /nonexistent/dsv2 does not exist"),
    (("model.checkpoint=/nonexistent",), "model.weights=synthetic builds seeded weights"),
    (("systems=[specter,nope]",), "unknown system 'nope'"),
    (("model=dsv2", "model.weights=synthetic", "mem=gb", "mem.gb=5"),
     "5 GB GPU budget is too small: it needs at least 10.89 GB"),
])
def test_bad_input_is_one_line_and_non_zero(tmp_path, monkeypatch, args, message):
    error = cli_error(tmp_path, monkeypatch, *args, f"results_dir={tmp_path / 'r'}")
    assert message in error and "\n" not in error
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("args,message", [
    (("model=nope",), "unknown model 'nope'"),  # before Hydra
    (("k=0",), "k must be an integer >= 1"),  # in run
])
def test_the_command_line_prints_one_line_and_exits_2(tmp_path, args, message):
    result = run_main(*args, f"results_dir={tmp_path / 'r'}", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error:") and message in result.stderr
    assert result.stderr.strip().count("\n") == 0
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("model", options("model"))
def test_model_options_agree_with_the_registry(model):
    """The model files show default K and memory presets; they must say what the registry says."""
    cfg = compose_with(f"model={model}")
    spec = model_choice(cfg).spec if model.startswith("tiny") else None
    from specter.models.registry import get_spec

    spec = spec or get_spec(model)
    assert cfg.model.default_k == spec.default_k
    assert dict(cfg.model.mem_presets) == spec.mem_presets


def test_summary_of_a_cut_run_is_rebuilt_from_its_records(tmp_path):
    out = tmp_path / "batch"
    result = run_main(f"results_dir={out}", "experiment=batch", "experiment.batch_sizes=[1,2]", "num_prompts=2",
                      "max_new_tokens=6", "repeats=1", "systems=[specter,mo_sm]", cwd=ROOT)
    assert result.returncode == 0, result.stderr
    written = pd.read_csv(out / "summary.csv")
    (out / "summary.csv").rename(out / "written.csv")  # as if the run had been cut before writing it
    rebuilt = summarize_dir(out)
    pd.testing.assert_frame_equal(pd.read_csv(out / "summary.csv"), written)
    assert set(rebuilt.batch_size.dropna()) == {1, 2}
    with pytest.raises(ValueError, match="never overwritten"):
        summarize_dir(out)
    assert summarize_main([str(tmp_path)]) == 2  # not a results directory: one-line error, exit 2


def test_k_auto_takes_the_depth_profile_of_the_same_workload_only(tmp_path):
    profile = tmp_path / "depth" / "dsv2-high"
    profile.mkdir(parents=True)
    calibrated = compose_with("model=dsv2", "k=auto", f"results_root={tmp_path}", "model.weights=calibrated")
    synthetic = compose_with("model=dsv2", "k=auto", f"results_root={tmp_path}", "model.weights=synthetic")
    (profile / "best_k.json").write_text(json.dumps({"best_k": 12, "workload": workload(calibrated)}))
    assert specter_config(calibrated, model_choice(calibrated).spec).k == 12
    with pytest.raises(SpecterError, match="is for dsv2: calibrated weights"):
        specter_config(synthetic, model_choice(synthetic).spec)


def save_tiny_checkpoint(name: str, path: Path, model_type: str | None = None) -> Path:
    """A tiny model saved as an HF checkpoint directory (config.json says its real model_type, or
    `model_type`), with a small BPE tokenizer (vocab 300 <= the model's 320)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    pristine_hf(name).save_pretrained(path)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["Natalia sold clips to 48 of her friends in April, and half as many in May."] * 4, trainer)
    words = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    words.save_pretrained(path)
    if model_type is not None:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("checkpoints")
    save_tiny_checkpoint("tiny-mixtral", root / "my mixtral")  # a space: the path must survive Hydra's parser
    save_tiny_checkpoint("tiny-dsv2", root / "tiny-ds")
    save_tiny_checkpoint("tiny-dsv2", root / "llama-like", model_type="llama")
    return root


CHECKPOINT_FAST = ("mem.slots=2", "num_prompts=1", "repeats=1", "max_new_tokens=4", "device=cpu")


def test_model_can_be_a_checkpoint_directory(tmp_path, checkpoints):
    """model=<dir>: the registered architecture of its config.json, its presets, results named after the dir."""
    ckpt = checkpoints / "my mixtral"
    result = run_main(f"model={ckpt}/", *CHECKPOINT_FAST, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    out = tmp_path / "results" / "main" / "my mixtral-high"
    assert {p.name for p in out.iterdir()} == {"records.csv", "summary.csv", "run.json"}
    run = json.loads((out / "run.json").read_text())
    assert run["complete"] and run["checkpoint"] == str(ckpt.resolve())
    model = run["config"]["model"]
    assert (model["name"], model["weights"], model["checkpoint"], model["label"]) == \
        ("mixtral", "checkpoint", str(ckpt), "my mixtral")
    assert model["default_k"] == 8  # the registry's Mixtral presets
    assert f"main: my mixtral (checkpoint {ckpt} as model=mixtral), K=8, 2 resident" in result.stdout
    records = pd.read_csv(out / "records.csv")
    assert set(records.system) == {"specter", "specter_paper", "target_only"} and (records.status == "ok").all()


def test_checkpoint_overrides_keep_what_the_command_line_gives(checkpoints):
    ckpt = checkpoints / "tiny-ds"
    assert checkpoint_overrides([f"model={ckpt}", "mem=low"]) == [
        "model=dsv2", f"model.checkpoint={ckpt}", "model.weights=checkpoint", "model.label=tiny-ds", "mem=low"]
    assert checkpoint_overrides(["model.weights=synthetic", f"model={ckpt}/", "model.label=x"]) == [
        "model.weights=synthetic", "model=dsv2", f"model.checkpoint={ckpt}", "model.label=x"]
    assert checkpoint_overrides(["model=dsv2", "mem=low"]) == ["model=dsv2", "mem=low"]  # a conf/model option
    with pytest.raises(SpecterError, match="already names the checkpoint"):
        checkpoint_overrides([f"model={ckpt}", "model.checkpoint=/elsewhere"])


def test_model_label_names_the_default_results_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert results_dir(compose_with("model=qwen", "model.label=run-a")) == (Path("results/main/run-a-high"), False)
    with pytest.raises(SpecterError, match="plain name"):
        results_dir(compose_with("model.label=a/b"))


@pytest.mark.parametrize("args,message", [
    (("model=mixtral", "model.checkpoint={ckpt}/tiny-ds"),
     "checkpoint {ckpt}/tiny-ds is a deepseek_v2 model (config.json), not the mixtral of mixtral: "
     "pass model=dsv2 model.checkpoint={ckpt}/tiny-ds, or model={ckpt}/tiny-ds"),
    (("model={ckpt}/llama-like",), "checkpoint {ckpt}/llama-like has model_type 'llama', which Specter does not "
                                   "support; supported: deepseek_v2 (model=dsv2), mixtral (model=mixtral)"),
    (("model=dsv2", "model.checkpoint={ckpt}/llama-like"), "has model_type 'llama', which Specter does not support"),
    (("model={ckpt}/absent/",), "checkpoint path {ckpt}/absent does not exist"),
    (("model={ckpt}",), "{ckpt} is not an HF checkpoint directory (no config.json)"),
], ids=["other-architecture", "unsupported-type", "unsupported-type-explicit", "absent", "no-config-json"])
def test_bad_checkpoint_directory_is_one_line_and_non_zero(tmp_path, monkeypatch, checkpoints, args, message):
    error = cli_error(tmp_path, monkeypatch, *(a.format(ckpt=checkpoints) for a in args), *CHECKPOINT_FAST,
                      f"results_dir={tmp_path / 'r'}")
    assert message.format(ckpt=checkpoints) in error and "\n" not in error
    assert not (tmp_path / "r").exists()
