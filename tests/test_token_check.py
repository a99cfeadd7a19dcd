"""Same tokens: equal, a numeric tie of the dtype (the target itself flips between forward shapes, or its gap is
within the dtype's bound), or a mismatch; the teacher-forced replay of Specter's verify windows."""
import pytest
import torch

import specter
from baselines.target_only import TargetOnly
from experiments.token_check import (EQUAL, MISMATCH, TIE, TokenCheck, check_tokens, classify, dtype_bound,
                                     first_divergence, incremental_logits, replay_windows, target_logits)
from tests.conftest import prompt


def test_the_first_divergence_is_the_first_different_token_or_where_the_shorter_list_ends():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_the_bound_is_twice_the_shape_difference_plus_one_ulp_of_the_dtype():
    one = torch.tensor([4.0, 3.9, -1.0])
    other = torch.tensor([3.99, 3.92, -1.0])  # the same logits in another forward shape
    ulp = torch.finfo(torch.bfloat16).eps * 4  # bfloat16's spacing at 4.0: 2**-5
    assert dtype_bound(one, other, torch.bfloat16) == pytest.approx(2 * 0.02 + ulp)
    assert dtype_bound(one, one, torch.float32) == pytest.approx(torch.finfo(torch.float32).eps * 4)


@pytest.mark.parametrize("gap, bound, flips, verdict", [
    (0.01, 0.05, False, TIE),       # within the dtype's bound
    (0.2, 0.05, True, TIE),         # the target picks the system's token in the verify shape itself
    (0.2, 0.05, False, MISMATCH),   # a wide gap the shapes agree on: a bug
])
def test_the_classifier_tells_ties_from_mismatches(gap, bound, flips, verdict):
    assert classify(gap, bound, flips) == verdict


def test_each_verdict_reads_as_one_phrase():
    assert TokenCheck(EQUAL).text() == "equal"
    assert TokenCheck(TIE, 7, 0.0312, 0.0625).text() == "numeric tie at token 7 (gap 0.0312 <= bound 0.0625)"
    flipped = TokenCheck(TIE, 7, 0.5, 0.25).text()
    assert flipped.endswith("bound 0.25: the target computed the system's way picks its token)")
    assert TokenCheck(MISMATCH, 7, 1.5, 0.0625).text() == "MISMATCH at token 7 (gap 1.5 > bound 0.0625)"
    assert "replay of its verify windows differs at token 9" in TokenCheck(MISMATCH, 7, 1.5, 0.1, 9).text()


@pytest.fixture(scope="module")
def tiny():
    model = specter.load_model("tiny", device="cpu", dtype=torch.float32)
    target = TargetOnly(model, 2)  # offloaded: the logits come through the target's own expert cache
    ids = prompt()
    return model, target, ids, target.generate(ids, 12).token_ids


def test_target_onlys_own_computation_and_a_verify_shape_give_its_next_token(tiny):
    model, target, ids, reference = tiny
    one = incremental_logits(target, ids, reference, 5)
    verify = target_logits(target, torch.cat([ids, torch.tensor([reference[:5]])], dim=1), 5)
    assert int(one.argmax()) == reference[5] and int(verify.argmax()) == reference[5]
    assert (one - verify).abs().max() < 1e-4  # float32: two shapes agree closely


def test_specters_windows_replayed_through_the_target_give_its_tokens_and_a_forged_token_is_caught(tiny):
    model, target, ids, reference = tiny
    engine = specter.SpecterEngine(model, specter.SpecterConfig(k=3, resident_experts_per_layer=2))
    result = engine.generate(ids, 12)
    windows = result.stats["windows"]
    assert result.token_ids == reference and sum(n + 1 for _, n in windows) == 11  # the first token is the prefill's
    replay, seen = replay_windows(target, ids, result.token_ids, windows, at=6)
    assert replay is None and int(seen.argmax()) == reference[6]
    assert (seen - incremental_logits(target, ids, reference, 6)).abs().max() < 1e-4
    forged = list(result.token_ids)
    forged[6] = (forged[6] + 1) % model.vocab_size
    assert replay_windows(target, ids, forged, windows)[0] == 6
    assert check_tokens(target, ids, result.token_ids, reference, 3, windows) == TokenCheck(EQUAL)
    verdict = check_tokens(target, ids, forged, reference, 3, windows)
    assert verdict.verdict == MISMATCH and verdict.position == 6 and verdict.replay == 6


def test_a_float32_divergence_wider_than_its_bound_is_a_mismatch(tiny):
    model, target, ids, reference = tiny
    logits = incremental_logits(target, ids, reference, 4)
    second = int(logits.topk(2).indices[1])  # the target's runner-up at token 4
    tokens = reference[:4] + [second] + reference[5:]
    verdict = check_tokens(target, ids, tokens, reference, 3)
    assert verdict.verdict == MISMATCH and verdict.position == 4
    assert verdict.gap == pytest.approx(float(logits[reference[4]] - logits[second])) and verdict.gap > verdict.bound
