"""The measurement protocol with stand-in systems: token caps for slow systems, prefix token checks."""
import torch

from experiments.protocol import run_cases
from experiments.records import RecordWriter
from specter.errors import SpecterError
from specter.metrics import GenerationResult


class Counting:
    """Emits 0, 1, 2, ... (target-only) or the same with one token changed at `wrong`."""

    def __init__(self, name: str, wrong: int | None = None) -> None:
        self.name, self.wrong, self.calls = name, wrong, []

    def available(self):
        return True, ""

    def generate(self, input_ids, max_new_tokens):
        self.calls.append(max_new_tokens)
        tokens = [-1 if i == self.wrong else i for i in range(max_new_tokens)]
        return GenerationResult(tokens, {"generated_tokens": max_new_tokens, "tpot_ms": 1.0})


def test_a_capped_system_decodes_fewer_tokens_checked_against_the_same_prefix(tmp_path):
    target, slow, wrong = Counting("target_only"), Counting("slow"), Counting("wrong", wrong=2)
    writer = RecordWriter(tmp_path)
    prompts = {"builtin": [torch.tensor([[1, 2, 3]])]}
    run_cases([target, slow, wrong], prompts, 1, 12, writer, token_caps={"slow": 4, "wrong": 5})
    assert target.calls[-1] == 12 and slow.calls[-1] == 4 and wrong.calls[-1] == 5  # the last call is the case
    rows = {r["system"]: r for r in writer.rows}
    assert rows["slow"]["generated_tokens"] == 4 and rows["slow"]["tokens_match_target"] == "yes"
    assert rows["wrong"]["tokens_match_target"] == "no" and rows["wrong"]["token_check"] == "MISMATCH at token 2"
    assert rows["slow"]["token_check"] == "equal"
    assert rows["target_only"]["generated_tokens"] == 12


class Crashing(Counting):
    """A baseline whose engine dies (as a crashed worker process reports itself)."""

    def generate(self, input_ids, max_new_tokens):
        raise SpecterError("llama.cpp worker exited during generate (code -11, SIGSEGV)")


def test_a_system_failing_in_its_warm_up_becomes_an_unavailable_row_and_the_rest_run(tmp_path, capsys):
    target, crashing = Counting("target_only"), Crashing("llama_cpp")
    writer = RecordWriter(tmp_path)
    run_cases([crashing, target], {"builtin": [torch.tensor([[1, 2, 3]])]}, 1, 8, writer)
    rows = {r["system"]: r for r in writer.rows}
    assert rows["llama_cpp"]["status"] == ("unavailable: failed in its warm-up: llama.cpp worker exited during "
                                           "generate (code -11, SIGSEGV)")
    assert rows["target_only"]["generated_tokens"] == 8
    assert "llama_cpp failed in its warm-up" in capsys.readouterr().err


def test_each_system_warms_up_as_long_as_its_measured_cases_within_its_cap(tmp_path, capsys):
    target, slow = Counting("target_only"), Counting("slow")
    run_cases([target, slow], {"builtin": [torch.tensor([[1, 2, 3]])]}, 1, 12, RecordWriter(tmp_path),
              token_caps={"slow": 4})
    assert target.calls == [12, 12] and slow.calls == [4, 4]  # warm-up, then the case
    err = capsys.readouterr().err  # each warm-up says how long it took
    assert "warm-up: target_only, 12 tokens in " in err and "warm-up: slow, 4 tokens in " in err
    short = Counting("target_only")
    (tmp_path / "b").mkdir()
    run_cases([short], {"builtin": [torch.tensor([[1, 2, 3]])]}, 1, 12, RecordWriter(tmp_path / "b"), warmup_tokens=5)
    assert short.calls == [5, 12]


def test_a_resumed_run_skips_systems_whose_cases_are_done(tmp_path):
    prompts = {"builtin": [torch.tensor([[1, 2, 3]])]}
    run_cases([Counting("target_only"), Counting("slow")], prompts, 1, 6, RecordWriter(tmp_path))
    target, slow = Counting("target_only"), Counting("slow")
    run_cases([target, slow], prompts, 2, 6, RecordWriter(tmp_path, resume=True))  # one more repeat
    assert target.calls == [6, 6] and slow.calls == [6, 6]  # warm-up, then repeat 1 only
    target, slow = Counting("target_only"), Counting("slow")
    run_cases([target, slow], prompts, 2, 6, RecordWriter(tmp_path, resume=True))
    assert target.calls == [] and slow.calls == []  # nothing left: no warm-up either
