"""Text in, text out: specter.text.generate_text, its incremental detokenizer and `python -m specter generate`."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import specter
from specter.__main__ import main, mechanisms
from specter.errors import SpecterError
from specter.metrics import GenerationResult
from specter.models.tokenizer import ByteTokenizer
from specter.speculative.state import StateManager
from specter.text import decode_text, encode_prompt, generate_text, printable, stream_decoder
from tests.conftest import tiny_model
from tests.hub_checkpoints import write_hub_checkpoint

ROOT = Path(__file__).resolve().parent.parent
SUMMARY = re.compile(r"^\[\d+ tokens, TPOT (\S+ ms|n/a), acceptance \S+, mechanisms: .+\]$")
EOS = ByteTokenizer.eos_token_id


def tiny_engine() -> specter.SpecterEngine:
    return specter.SpecterEngine(tiny_model("tiny"), specter.SpecterConfig(k=4, resident_experts_per_layer=4))


class ScriptedEngine:
    """An engine that commits fixed chunks of byte ids (EOS and what follows it included) through on_commit."""

    def __init__(self, chunks: list[list[int]], tokenizer=None) -> None:
        self.model = type("Model", (), {"tokenizer": tokenizer or ByteTokenizer()})()
        self.chunks, self.calls = chunks, []

    def generate(self, input_ids, max_new_tokens, eos_token_id=None, on_commit=None):
        self.calls.append((input_ids.tolist(), max_new_tokens, eos_token_id))
        tokens = [t for chunk in self.chunks for t in chunk][:max_new_tokens]
        for chunk in self.chunks if on_commit is not None else ():
            on_commit(chunk)
        cut = tokens[: tokens.index(eos_token_id) + 1] if eos_token_id in tokens else tokens
        return GenerationResult(cut, {"tpot_ms": 1.0})


def pushed(tokenizer, ids, step: int = 1, eos=None) -> tuple[list[str], str]:
    """The pieces a stream decoder emits when `ids` arrive `step` at a time, and its final text."""
    pieces = []
    push = stream_decoder(tokenizer, pieces.append, eos)
    for i in range(0, len(ids), step):
        push(ids[i:i + step])
    return pieces, push.finish()


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    return write_hub_checkpoint("qwen", tmp_path_factory.mktemp("hub") / "Qwen1.5-MoE-A2.7B")


def test_text_is_the_decode_of_the_engines_tokens():
    engine = tiny_engine()
    result = generate_text(engine, "Hello", 8)
    tokenizer = engine.model.tokenizer
    plain = engine.generate(torch.tensor([tokenizer.encode("Hello")]), 8, eos_token_id=EOS)
    assert result.token_ids == plain.token_ids and 1 <= len(result.token_ids) <= 8
    assert result.text == tokenizer.decode(result.token_ids)
    assert result.stats["generated_tokens"] == len(result.token_ids) and "tpot_ms" in result.stats
    with pytest.raises(AttributeError):
        result.text = "frozen"


def test_streamed_pieces_concatenate_to_the_text():
    pieces = []
    result = generate_text(tiny_engine(), "Hello", 8, stream=pieces.append)
    assert "".join(pieces) == result.text and all(pieces)


def test_streaming_is_per_commit_when_the_engine_has_the_hook():
    engine = tiny_engine()
    commits, pieces = [], []
    original = StateManager.commit
    with pytest.MonkeyPatch.context() as patch:  # count the commits the hook reports
        patch.setattr(StateManager, "commit", lambda s, t, kv_keep: (commits.append(list(t)), original(s, t, kv_keep)))
        result = generate_text(engine, "Natalia sold clips", 16, stream=pieces.append, eos=False)
    assert len(commits) > 1 and sum(map(len, commits)) == len(result.token_ids) == 16
    assert result.token_ids == generate_text(tiny_engine(), "Natalia sold clips", 16, eos=False).token_ids
    assert "".join(pieces) == result.text


def test_stream_decoder_holds_back_a_character_split_across_tokens():
    text = "aé 😀!✓"
    pieces, final = pushed(ByteTokenizer(), list(text.encode()))
    assert pieces == ["a", "é", " 😀", "!", "✓"] and final == text
    pieces, final = pushed(ByteTokenizer(), list(text.encode()), step=3)
    assert "".join(pieces) == final == text and not any("\ufffd" in p for p in pieces)


def test_stream_decoder_flushes_a_broken_byte_and_stops_at_eos():
    ids = [0xE2, 0x82, ord("x"), 0xF0, EOS, ord("z")]  # a truncated sequence, then one cut off by EOS
    pieces, final = pushed(ByteTokenizer(), ids, eos=EOS)
    assert final == ByteTokenizer().decode(ids[:5]) == "\ufffdx\ufffd"
    assert pieces == ["\ufffdx", "\ufffd"]


def test_stream_decoder_with_a_byte_level_bpe_tokenizer(qwen_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(qwen_dir)
    text = "héllo ✓ 😀 naïve"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode(ids[:i]) for i in range(len(ids)))  # some token splits a character
    pieces, final = pushed(tokenizer, ids + [tokenizer.eos_token_id])
    assert "".join(pieces) == final == text and not any("\ufffd" in p for p in pieces)


def test_commits_after_eos_are_not_streamed():
    engine = ScriptedEngine([[0xC3], [0xA9, ord("a")], [EOS, ord("z")]])
    pieces = []
    result = generate_text(engine, "hi", 8, stream=pieces.append)
    assert engine.calls == [([[256, ord("h"), ord("i")]], 8, EOS)]
    assert result.token_ids == [0xC3, 0xA9, ord("a"), EOS] and result.text == "éa" and pieces == ["éa"]
    generate_text(engine, "hi", 3, eos=False)
    assert engine.calls[-1][2] is None


class Silent(ByteTokenizer):
    def encode(self, text, add_bos=True):
        return []


@pytest.mark.parametrize("prompt,max_new_tokens,kwargs,message", [
    ("", 8, {}, "the prompt is empty"),
    (123, 8, {}, "the prompt must be a string, got int"),
    ("hi", 0, {}, "max_new_tokens must be an integer >= 1, got 0"),
    ("hi", True, {}, "max_new_tokens must be an integer >= 1, got True"),
    ("hi", 8, {"chat": True}, "chat needs a chat template and this model's tokenizer has none"),
    ("hi", 8, {"tokenizer": Silent()}, "encodes to no tokens"),
])
def test_bad_input_is_one_line(prompt, max_new_tokens, kwargs, message):
    engine = ScriptedEngine([[ord("a")]], kwargs.pop("tokenizer", None))
    with pytest.raises(SpecterError, match=re.escape(message)) as info:
        generate_text(engine, prompt, max_new_tokens, **kwargs)
    assert "\n" not in str(info.value) and not engine.calls


def test_chat_applies_the_tokenizers_template(qwen_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(qwen_dir)
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    ids = encode_prompt(tokenizer, "hi", chat=True)
    assert decode_text(tokenizer, ids) == "user\nhi\nassistant\n"  # the markers are special tokens
    assert tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_mechanisms_line():
    stats = {"mechanisms": {"residual_transfer": "on", "draft_ahead": "off: needs CUDA"}, "draft_graph": "off"}
    assert mechanisms(stats) == "residual_transfer on, draft_ahead off (needs CUDA)"
    assert mechanisms({"draft_graph": "off", "draft_ahead": "on"}) == "draft_graph off, draft_ahead on"
    assert mechanisms({}) == "none reported"


def run_specter(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "specter", *args], check=False, cwd=ROOT, capture_output=True,
                          env=env, timeout=300)


@pytest.mark.slow
def test_command_line_streams_the_text_and_a_summary():
    done = run_specter("generate", "--model", "tiny", "--mem", "high", "--max-new-tokens", "8", "--device", "cpu",
                       "Hello")
    stderr = done.stderr.decode()
    assert done.returncode == 0, stderr
    assert done.stdout.decode() == printable(generate_text(tiny_engine(), "Hello", 8).text) + "\n"
    assert SUMMARY.match(stderr.strip().splitlines()[-1]) and "tokens" in stderr


def test_command_line_error_is_one_line_and_exit_2(tmp_path):
    done = run_specter("generate", "--model", str(tmp_path / "missing"), "--mem", "high", "Hello")
    assert done.returncode == 2 and done.stdout == b""
    assert done.stderr.decode().count("\n") == 1 and done.stderr.startswith(b"error: ") and b"does not exist" in done.stderr


@pytest.mark.parametrize("args,message", [
    (["--model", "banana-model", "--mem", "high", "Hello"], "unknown model 'banana-model'"),
    (["--model", "tiny", "--mem", "banana", "Hello"], "--mem: must be high, low or a number of GB above 0"),
    (["--model", "/nonexistent/checkpoint", "--mem", "high", "Hello"], "does not exist"),
    (["--model", "tiny", "--mem", "high", ""], "the prompt is empty"),
    (["--model", "tiny", "--mem", "high", "--max-new-tokens", "0", "Hello"], "max_new_tokens must be"),
    (["--model", "tiny", "--mem", "0.01", "Hello"], "a 0.01 GB GPU budget is too small"),
    (["--mem", "high", "Hello"], "the following arguments are required: --model"),
])
def test_bad_arguments_give_one_error_line(args, message, capsys):
    assert main(["generate", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ") and message in err


def test_help(capsys):
    for argv in (["--help"], ["generate", "--help"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 0
    assert "--max-new-tokens" in capsys.readouterr().out


def test_chat_without_a_template_is_one_error_line(capsys):
    assert main(["generate", "--model", "tiny", "--mem", "high", "--chat", "Hello"]) == 2
    assert capsys.readouterr().err == ("error: chat needs a chat template and this model's tokenizer has none; "
                                       "give the prompt as plain text (without chat)\n")


def test_a_checkpoint_directory_with_a_chat_template_and_a_gb_budget(qwen_dir, tmp_path, capsys):
    directory = tmp_path / qwen_dir.name
    directory.mkdir()
    for file in qwen_dir.iterdir():
        (directory / file.name).symlink_to(file)
    config = json.loads((qwen_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (directory / "tokenizer_config.json").unlink()
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    argv = ["generate", "--model", str(directory), "--mem", "1.5", "--chat", "--max-new-tokens", "6", "--device", "cpu"]
    assert main([*argv, "def fibonacci(n):"]) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n") and SUMMARY.match(err.strip().splitlines()[-1]) and "random weights" not in err


@pytest.mark.slow
def test_command_line_on_a_checkpoint_directory(qwen_dir):
    done = run_specter("generate", "--model", str(qwen_dir), "--mem", "low", "--max-new-tokens", "8", "--device", "cpu",
                       "def fibonacci(n):")
    stderr = done.stderr.decode()
    assert done.returncode == 0, stderr
    assert done.stdout.decode().endswith("\n") and len(done.stdout.decode()) > 1
    assert SUMMARY.match(stderr.strip().splitlines()[-1])
