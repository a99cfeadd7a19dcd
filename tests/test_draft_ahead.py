"""Draft-ahead: the next window drafted during the verify pass; lossless, used when the window is accepted
whole with the guessed bonus token, off where it cannot apply, and the KV rows it copies."""
import pytest
import torch
from transformers import DynamicCache, StaticCache

import specter
from specter.models.hybrid_experts import TARGET
from specter.draft.side_steps import SideSteps
from specter.speculative.state import copy_rows
from tests.conftest import TINY_MODELS, hf_greedy, prompt, tiny_model

NEW = 32
pytestmark = pytest.mark.usefixtures("draft_ahead_on_cpu")  # its logic on the CPU, where it is off by default


@pytest.mark.parametrize("slots", [None, 2])
@pytest.mark.parametrize("tiny_name", TINY_MODELS)
def test_draft_ahead_is_lossless_and_used(tiny_name, slots):
    model = specter.load_model(tiny_name, device="cpu", dtype=torch.float32) if slots else tiny_model(tiny_name)
    config = specter.SpecterConfig(k=3, resident_experts_per_layer=slots, draft_ahead=True)
    out = specter.SpecterEngine(model, config).generate(prompt("Natalia sold clips"), NEW)
    assert out.token_ids == hf_greedy(tiny_name, prompt("Natalia sold clips"), NEW), (tiny_name, slots)
    assert out.stats["draft_ahead"] == "on"
    assert 0 < out.stats["draft_ahead_windows"] <= out.stats["draft_ahead_launches"]
    assert out.stats["draft_ahead_launch_host_ms"] > 0
    if slots:  # offloaded: every window that drafts, ahead or not, has a plan (a last one of k=0 has none)
        assert out.stats["iterations"] - 1 <= len(out.stats["prefetch_trace"]) <= out.stats["iterations"]


@pytest.mark.parametrize("slots", [None, 2])
@pytest.mark.parametrize("tiny_name", ["tiny-dsv2", "tiny-qwen"])
def test_the_first_window_drafted_from_the_prompt_is_lossless_and_taken(tiny_name, slots):
    """The first window is drafted from the prompt (the draft's own KV rows of it) before the prefill; it is
    taken when the draft's guess is the target's first token, and tokens stay the target's."""
    model = specter.load_model(tiny_name, device="cpu", dtype=torch.float32) if slots else tiny_model(tiny_name)
    ids, expected = prompt("Natalia sold clips"), hf_greedy(tiny_name, prompt("Natalia sold clips"), NEW)
    config = specter.SpecterConfig(k=3, resident_experts_per_layer=slots, draft_ahead=True)
    engine, drafted = specter.SpecterEngine(model, config), []
    draft = engine.draft
    engine.draft = lambda state, k, *rest: drafted.append(k) or draft(state, k, *rest)
    stats = engine.generate(ids, NEW).stats
    assert engine.generate(ids, NEW).token_ids == expected, (tiny_name, slots)
    # the draft guesses these prompts' first token: the first window takes the prompt's drafts
    assert stats["draft_ahead_prompt_windows"] == 1
    taken = stats["draft_ahead_windows"] + stats["draft_ahead_prompt_windows"]
    assert len(drafted) // 2 == stats["iterations"] - taken  # two requests: windows that drafted themselves


def test_a_first_token_the_draft_did_not_guess_leaves_the_prompt_drafts_unused():
    """When the target's first token is not the draft's guess, the first window drafts as usual and the
    counts of the prompt's drafts are cleared."""
    engine = specter.SpecterEngine(tiny_model("tiny-dsv2"), specter.SpecterConfig(k=3, draft_ahead=True))
    collect, seen = engine.ahead.collect_prompt, []

    def wrong_first_token(launched, first):
        seen.append(first)
        return collect(launched, first + 1)

    engine.ahead.collect_prompt = wrong_first_token
    ids = prompt("Natalia sold clips")
    out = engine.generate(ids, NEW)
    assert seen and out.stats["draft_ahead_prompt_windows"] == 0
    assert out.token_ids == hf_greedy("tiny-dsv2", ids, NEW)


def test_drafts_made_ahead_that_no_window_takes_leave_no_counts():
    engine = specter.SpecterEngine(tiny_model("tiny"), specter.SpecterConfig(k=3, draft_ahead=True))
    engine.elb.counts.fill_(1)  # as if a draft-ahead had counted its routing
    engine.ahead.discard()
    assert int(engine.elb.counts.sum()) == 0


def test_side_steps_without_a_stream_run_every_step_at_once():
    queued = []

    def chain():
        for i in range(5):
            queued.append(i)
            yield torch.tensor([[i]])

    steps = SideSteps(chain(), None)  # no stream (the CPU): the steps run now
    assert queued == list(range(5))
    assert [int(t) for t in steps.finish()] == list(range(5))


@pytest.mark.parametrize("name,config,reason", [
    ("tiny", dict(temperature=0.7), "off: sampling"), ("tiny", dict(draft_ahead=False), "off: not asked")])
def test_draft_ahead_is_off_where_it_cannot_apply(name, config, reason):
    settings = {"k": 3, "draft_ahead": True, **config}
    out = specter.SpecterEngine(tiny_model(name), specter.SpecterConfig(**settings)).generate(prompt(), 8)
    assert out.stats["mechanisms"]["draft_ahead"].startswith(reason)
    assert "draft_ahead_launches" not in out.stats


@pytest.mark.parametrize("static", [False, True])
def test_copy_rows_takes_the_committed_rows_and_keeps_its_own(static):
    model = tiny_model("tiny")
    make = (lambda: StaticCache(config=model.hf.config, max_cache_len=16)) if static else \
        (lambda: DynamicCache(config=model.hf.config))
    src, dst = make(), make()
    with torch.inference_mode():
        model.forward(prompt()[:, :6], src, TARGET)
        model.forward(prompt()[:, 1:9], dst, TARGET)  # other rows in dst
        before = [layer.keys[:, :, :8].clone() for layer in dst.layers]
        copy_rows(dst, src, 4, 7)
    for layer, src_layer, old in zip(dst.layers, src.layers, before):
        assert torch.equal(layer.keys[:, :, :4], src_layer.keys[:, :, :4])
        assert torch.equal(layer.keys[:, :, 4:7], old[:, :, 4:7])  # its own rows past the copied ones
        assert torch.equal(layer.values[:, :, :4], src_layer.values[:, :, :4])
        length = int(layer.cumulative_length) if static else layer.get_seq_length()
        assert length == 7


def test_a_batch_does_not_draft_ahead_and_says_so():
    engine = specter.SpecterEngine(tiny_model("tiny"), specter.SpecterConfig(k=3, draft_ahead=True))
    results = engine.generate([prompt()[0].tolist(), prompt("def f(x):")[0].tolist()], 8)
    assert all(r.stats["mechanisms"]["draft_ahead"].startswith("off: batched") for r in results)
    assert all("draft_ahead_launches" not in r.stats for r in results)
    single = engine.generate(prompt(), 8)  # a single request after the batch drafts ahead again
    assert single.stats["mechanisms"]["draft_ahead"] == "on" and single.stats["draft_ahead_launches"] > 0


@pytest.mark.parametrize("new,from_prompt", [(1, 0), (2, 0), (3, 1)])
def test_short_requests_draft_from_the_prompt_only_when_a_window_follows(new, from_prompt):
    """One or two new tokens leave no window to draft from the prompt; three leave a window of one token."""
    engine = specter.SpecterEngine(tiny_model("tiny-dsv2"), specter.SpecterConfig(k=4, draft_ahead=True))
    out = engine.generate(prompt("Natalia sold clips"), new)
    assert out.token_ids == hf_greedy("tiny-dsv2", prompt("Natalia sold clips"), new)
    assert out.stats["draft_ahead_prompt_windows"] == from_prompt
