"""The draft-graph cache: one static KV cache and captured step per batch shape, kept while it fits (CPU: no
capture), and the draft step it captures, plain or compiled."""
import pytest
import torch

from specter.draft.graph import DraftGraphCache, draft_step_fn
from specter.prefetch.lookahead import ExpertLookaheadBuffer
from specter.speculative.state import new_static_cache
from tests.conftest import tiny_model


def graphs() -> DraftGraphCache:
    model = tiny_model("tiny")
    return DraftGraphCache(model, ExpertLookaheadBuffer(model.num_moe_layers, model.num_experts, model.device))


def test_a_single_requests_cache_is_kept_while_requests_fit_and_grows():
    cache = graphs()
    first = cache.static_cache(None, 40, min_length=256)
    assert first.max_cache_len == 256 and cache.static_cache(None, 256, min_length=256) is first
    longer = cache.static_cache(None, 300, min_length=256)
    assert longer is not first and longer.max_cache_len == 300
    assert cache.static_cache(None, 100, min_length=256) is longer  # a shorter request fits the longer cache


def test_a_batchs_cache_is_made_for_one_shape_and_lives_beside_the_single_one():
    cache = graphs()
    single = cache.static_cache(None, 40, min_length=256)
    batch = cache.static_cache(4, 256)
    assert cache.static_cache(4, 256) is batch and cache.static_cache(None, 40) is single
    assert cache.static_cache(2, 256) is not batch  # another batch size
    assert cache.static_cache(2, 512).max_cache_len == 512 and cache.static_cache(2, 256).max_cache_len == 256


def test_capture_is_tried_once_per_cache_and_only_over_the_entrys_cache():
    cache = graphs()
    assert cache.status(None) == "off"
    static = cache.static_cache(None, 40, min_length=64)
    assert cache.capture(None, torch.zeros(1), 0) is None and cache.status(None) == "off"  # not its cache
    assert cache.capture(None, static, 0) is None
    assert cache.status(None) == "failed: no CUDA device" and cache.graph(None, static) is None
    cache.static_cache(None, 100)  # a new cache: its graph is to be captured again
    assert cache.status(None) == "off"


@pytest.mark.slow
def test_the_compiled_draft_step_gives_the_plain_steps_tokens():
    """draft_compile's step function (torch.compile, static shapes) against the plain one, each over its own
    static KV cache, for a few greedy steps (CPU: the experts run through the torch reference)."""
    model = tiny_model("tiny-qwen")
    plain, compiled = draft_step_fn(model), draft_step_fn(model, compiled=True)
    with torch.inference_mode():
        caches = new_static_cache(model, 16), new_static_cache(model, 16)
        tokens = [torch.tensor([[7]]), torch.tensor([[7]])]
        for _ in range(4):
            tokens = [plain(tokens[0], caches[0], None, None), compiled(tokens[1], caches[1], None, None)]
            assert tokens[0].shape == (1, 1) and torch.equal(tokens[0], tokens[1])
    assert int(caches[1].layers[0].cumulative_length) == 4  # the compiled step wrote its KV too


def test_the_cache_passes_compile_on_and_a_cpu_still_drafts_eagerly():
    model = tiny_model("tiny")
    cache = DraftGraphCache(model, ExpertLookaheadBuffer(model.num_moe_layers, model.num_experts, model.device),
                            compiled=True)
    static = cache.static_cache(None, 40, min_length=64)
    assert cache.compiled and cache.capture(None, static, 0) is None
    assert cache.status(None) == "failed: no CUDA device"


def test_the_compiled_step_runs_with_room_for_one_entry_per_layer_and_cache(monkeypatch):
    """The host tap's graph break makes every decoder layer a frame of its own (specialised on its index):
    the compiled step raises dynamo's recompile limit (8) while it runs, or layers past the eighth stay eager;
    and inductor rounds its fused kernels as eager rounds (emulate_precision_casts) only while it runs."""
    seen, rounding = [], []

    def fake_compile(fn, dynamic):
        def run(*args):
            seen.append(torch._dynamo.config.recompile_limit)
            rounding.append(torch._inductor.config.emulate_precision_casts)
            return fn(*args)
        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    model = tiny_model("tiny")
    step = draft_step_fn(model, compiled=True)
    with torch.inference_mode():
        token = step(torch.tensor([[7]]), new_static_cache(model, 8), None, None)
    assert token.shape == (1, 1)
    assert seen == [max(8, 8 * model.hf.config.num_hidden_layers)] and torch._dynamo.config.recompile_limit == 8
    assert rounding == [True] and not torch._inductor.config.emulate_precision_casts
