"""What `python -m specter generate` shows: printable text, a note for random weights, and prompts that fit the context."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

import specter
from baselines.hf_transformers import Transformers
from baselines.mixtral_offloading import MixtralOffloading
from baselines.specmoeoff.engine import SpecMoEOff, SpecMoEOffConfig
from baselines.target_only import TargetOnly
from specter.__main__ import main, random_weights_note
from specter.errors import SpecterError
from specter.inputs import check_batch, check_prompt
from specter.models.registry import get_spec
from specter.text import generate_text, printable
from tests.conftest import tiny_model

SUMMARY = re.compile(r"^\[\d+ tokens, TPOT (\S+ ms|n/a), acceptance \S+, mechanisms: .+\]$")
TOO_LONG = re.compile(r"^the prompt is \d+ tokens and max_new_tokens \d+; this model's context holds 1024 positions: "
                      r"shorten the prompt or lower max_new_tokens$")


@pytest.mark.parametrize("text,shown", [
    ("plain text, 123 and é 😀", "plain text, 123 and é 😀"),
    ("bell\x07 escape\x1b[31m carriage\r", "bell\\x07 escape\\x1b[31m carriage\\r"),
    ("line\nnext\ttab", "line\nnext\ttab"),
    ("\x00\x7f\x85", "\\x00\\x7f\\x85"),
    ("right-to-left \u202e override", "right-to-left \\u202e override"),
    ("no-break\xa0space, joined 👩\u200d💻", "no-break\xa0space, joined 👩\u200d💻"),
    ("\ufffd replacement stays", "\ufffd replacement stays"),
])
def test_printable_escapes_what_a_terminal_would_act_on(text, shown):
    assert printable(text) == shown
    assert printable(shown) == shown


def test_generate_prints_escaped_text_and_says_the_weights_are_random(capsys):
    prompt, new = "Once upon a time", 32
    engine = specter.SpecterEngine(tiny_model("tiny"), specter.SpecterConfig(k=4, resident_experts_per_layer=4))
    raw = generate_text(engine, prompt, new).text
    assert printable(raw) != raw  # the random weights do give control bytes
    assert main(["generate", "--model", "tiny", "--mem", "high", "--max-new-tokens", str(new), "--device", "cpu",
                 prompt]) == 0
    out, err = capsys.readouterr()
    assert out == printable(raw) + "\n"
    lines = err.strip().splitlines()
    assert lines[-2] == "note: tiny-dsv2 has random weights (no checkpoint), so its text is not meaningful"
    assert SUMMARY.match(lines[-1])


def test_only_seeded_models_get_the_note():
    assert random_weights_note(SimpleNamespace(spec=get_spec("tiny-qwen"))).startswith("note: tiny-qwen has random")
    assert random_weights_note(SimpleNamespace(spec=get_spec("dsv2"))) is None


def test_a_prompt_longer_than_the_context_is_one_error_line_and_exit_2(capsys):
    assert main(["generate", "--model", "tiny", "--mem", "high", "--device", "cpu", "x" * 20_000]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ")
    assert TOO_LONG.match(err[len("error: "):].strip()) and "20001 tokens and max_new_tokens 128" in err


def test_check_prompt_refuses_what_the_context_cannot_hold():
    prompt = torch.zeros(1, 1000, dtype=torch.long)
    assert check_prompt(prompt, 24, 300, max_positions=1024).shape == (1, 1000)  # exactly full
    assert check_prompt(prompt, 25, 300).shape == (1, 1000)  # no limit given
    with pytest.raises(SpecterError, match="the prompt is 1000 tokens and max_new_tokens 25; this model's context "
                                           "holds 1024 positions"):
        check_prompt(prompt, 25, 300, max_positions=1024)
    with pytest.raises(SpecterError, match="the prompt is 1000 tokens"):
        check_batch([[1, 2], prompt], 25, 300, max_positions=1024)


def test_the_model_knows_its_context():
    assert tiny_model("tiny").max_positions == get_spec("tiny").hf_config["max_position_embeddings"] == 1024


SYSTEMS = {
    "specter": lambda model: specter.SpecterEngine(model, specter.SpecterConfig(k=4, resident_experts_per_layer=4)),
    "target_only": lambda model: TargetOnly(model, 2),
    "mixtral_offloading": lambda model: MixtralOffloading(model, 2),
    "transformers": lambda model: Transformers(model, 2),
    "specmoeoff": lambda model: SpecMoEOff(model, SpecMoEOffConfig(slots=2, fixed_k=3)),
}


@pytest.mark.parametrize("system", SYSTEMS)
def test_every_system_refuses_a_prompt_past_the_context(system):
    engine = SYSTEMS[system](tiny_model("tiny"))
    prompt = torch.randint(0, 256, (1, 1020))
    with pytest.raises(SpecterError) as info:
        engine.generate(prompt, 8)
    assert TOO_LONG.match(str(info.value)) and "1020 tokens and max_new_tokens 8" in str(info.value)
    if system in ("specter", "target_only", "transformers", "specmoeoff"):  # the systems with a batch mode
        with pytest.raises(SpecterError, match="1020 tokens and max_new_tokens 8"):
            engine.generate([[1, 2, 3], prompt[0].tolist()], 8)


def test_the_library_refuses_a_text_prompt_past_the_context():
    engine = SYSTEMS["specter"](tiny_model("tiny"))
    with pytest.raises(SpecterError, match="the prompt is 20001 tokens and max_new_tokens 128"):
        generate_text(engine, "x" * 20_000)
    with pytest.raises(SpecterError, match="the prompt is 1001 tokens and max_new_tokens 24"):
        engine.generate_text("y" * 1000, 24)
