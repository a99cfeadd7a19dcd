"""Lookahead counters, pattern analyzer and the layer-aware prefetch planner (fake cost model)."""
import torch

from specter.models.hybrid_experts import DRAFT
from specter.offload.streams import DeviceStreams
from specter.prefetch.lookahead import ExpertLookaheadBuffer, PatternAnalyzer
from specter.prefetch.planner import (
    COLD_START,
    FINAL_CLEANUP,
    PREFETCH_OVERLAP,
    CostModel,
    PrefetchPlanner,
    early_read_layer,
)
from specter.speculative.state import StateManager
from tests.conftest import prompt, tiny_model
from tests.test_expert_cache import EXPERTS, LAYERS, make_cache

# draft token -> (layer 0 top-k, layer 1 top-k)
ROUTES = [([0, 1], [2, 3]), ([0, 2], [2, 4]), ([3, 0], [5, 0]), ([3, 1], [2, 0]), ([4, 0], [3, 2]),
          ([5, 5], [1, 1]), ([5, 1], [1, 4]), ([5, 2], [1, 3])]


def planner_with(slots: int, initial_chunk: int = 2, prefetch_chunk: int = 1):
    cache = make_cache(slots)
    elb = ExpertLookaheadBuffer(LAYERS, EXPERTS, torch.device("cpu"))
    cost = CostModel(draft_ms_per_token=1.0, h2d_bytes_per_ms=2 * cache.store.expert_bytes, frozen=True)
    planner = PrefetchPlanner(PatternAnalyzer(elb), cache, initial_chunk=initial_chunk, prefetch_chunk=prefetch_chunk,
                              cost=cost)
    return planner, elb, cache


def draft_window(planner, elb, k: int, on_token=None):
    """Draft k tokens of ROUTES through the planner; the window's plan."""
    planner.begin_window(k)
    for i in range(k):
        for layer, experts in enumerate(ROUTES[i]):
            elb.observe(layer, torch.tensor([experts]))
        planner.after_draft_token(i + 1)
        if on_token:
            on_token(i + 1)
    return planner.end_window()


def test_counters_match_reference_count():
    elb = ExpertLookaheadBuffer(LAYERS, EXPERTS, torch.device("cpu"))
    for routes in ROUTES:
        for layer, experts in enumerate(routes):
            elb.observe(layer, torch.tensor([experts]))
    for layer in range(LAYERS):
        flat = torch.tensor([e for routes in ROUTES for e in routes[layer]])
        assert torch.equal(elb.counts[layer], torch.bincount(flat, minlength=EXPERTS).int())
    ranking = PatternAnalyzer(elb).ranking()  # most frequent first, ties by id
    assert {layer: [e for e, _ in row[:2]] for layer, row in ranking.items()} == {0: [0, 5], 1: [1, 2]}
    assert ranking[0][:2] == [(0, 4), (5, 4)]  # (expert, count)


def test_engine_draft_counts_equal_the_draft_routing():
    model = tiny_model("tiny-qwen")
    elb = ExpertLookaheadBuffer(model.num_moe_layers, model.num_experts, model.device)
    seen = []

    def record(layer, top_k_index):
        seen.append((layer, top_k_index.clone()))
        elb.observe(layer, top_k_index)

    state = StateManager(model, prompt())
    state.prefill()
    with state.draft_scratch(), model.observe_draft_routing(record):
        for token in (5, 9, 11):
            model.forward(torch.tensor([[token]]), state.cache, DRAFT)
    assert len(seen) == 3 * model.num_moe_layers
    for layer in range(model.num_moe_layers):
        flat = torch.cat([idx.reshape(-1) for l, idx in seen if l == layer])
        assert torch.equal(elb.counts[layer], torch.bincount(flat, minlength=model.num_experts).int())


def test_nested_observers_restore_the_outer_one():
    model = tiny_model("tiny")
    outer, inner = [], []
    with model.observe_draft_routing(lambda layer, idx: outer.append(layer)):
        with model.observe_draft_routing(lambda layer, idx: inner.append(layer)):
            pass
        state = StateManager(model, prompt())
        state.prefill()
        with state.draft_scratch():
            model.forward(torch.tensor([[5]]), state.cache, DRAFT)
    assert inner == [] and outer == list(range(model.num_moe_layers))
    assert all(module.routing_observer is None for module in model.experts)


def test_phases_and_boundaries():
    planner, elb, cache = planner_with(slots=4, prefetch_chunk=8)
    loads_after = {}
    draft_window(planner, elb, 8, on_token=lambda i: loads_after.setdefault(i, cache.counters.prefetch_loads))
    trace = planner.traces[-1]
    assert loads_after[1] == 0  # cold start: the first chunk only observes
    # b1 = 2: top-4 plans {0,1,2} and {2,3,4}: 6 experts = 3 ms of H2D at 1 ms/token -> next boundary 5;
    # at 5 the plans {0,1,2,3} / {2,0,3,4} fill every slot -> final cleanup, nothing after
    assert trace.boundaries == [2, 5]
    assert trace.phases == [PREFETCH_OVERLAP, FINAL_CLEANUP]
    assert trace.batch_sizes == [6, 2]
    assert cache.resident_experts(0) == {0, 1, 2, 3} and cache.resident_experts(1) == {0, 2, 3, 4}
    assert int(elb.counts.sum()) == 0  # cleared at the end of the draft stage
    assert planner.phase == FINAL_CLEANUP


def test_default_batches_span_one_draft_step_and_go_most_routed_first():
    planner, elb, cache = planner_with(slots=4)  # prefetch_chunk=1: one draft step hides 2 experts
    resident_after = {}
    draft_window(planner, elb, 8, on_token=lambda i: resident_after.setdefault(
        i, (cache.resident_experts(0), cache.resident_experts(1))))
    trace = planner.traces[-1]
    assert trace.boundaries == [2, 3, 4, 5] and trace.batch_sizes == [2, 2, 2, 2]
    assert trace.phases[-1] == FINAL_CLEANUP
    assert resident_after[3] == ({0}, {2})  # routed twice in the first two steps
    assert cache.resident_experts(0) == {0, 1, 2, 3} and cache.resident_experts(1) == {0, 2, 3, 4}


def test_batches_are_issued_once_the_next_step_is_queued_and_capped_by_the_rest_of_the_draft():
    planner, elb, cache = planner_with(slots=4)
    planner.begin_window(3)
    for i, routes in enumerate(ROUTES[:3]):
        for layer, experts in enumerate(routes):
            elb.observe(layer, torch.tensor([experts]))
        planner.after_draft_token(i + 1)
        if i + 1 == 2:
            assert cache.counters.prefetch_loads == 0  # counters read at 2, batch issued after step 3
    plan = planner.end_window()
    trace = planner.traces[-1]
    # plan at 2: {0,1,2} / {2,3,4}, but one remaining draft token hides only 2 experts: the most routed go
    assert trace.boundaries == [2] and trace.batch_sizes == [2] and trace.phases == [FINAL_CLEANUP]
    assert cache.resident_experts(0) == {0} and cache.resident_experts(1) == {2}
    assert plan.prefetched == {0: {0}, 1: {2}}
    assert plan.load_order(0) == [0, 1, 2, 3] and plan.load_order(1) == [2, 0, 3, 4, 5]
    assert int(elb.counts.sum()) == 0


def test_tap_copies_the_early_layers_counts_when_the_step_reaches_them():
    elb = ExpertLookaheadBuffer(LAYERS, EXPERTS, torch.device("cpu"))
    elb.set_tap(0, DeviceStreams(torch.device("cpu")).tap((1, EXPERTS), torch.int32))
    elb.observe(0, torch.tensor([ROUTES[0][0]]))
    assert torch.equal(elb.tap.result(), elb.counts[:1])
    elb.observe(1, torch.tensor([ROUTES[0][1]]))
    elb.counts[0, 5] += 7  # changes after the tapped layer are not in the copy
    assert int(elb.tap.result()[0, 5]) == 0 and int(elb.tap.result().sum()) == 2


def test_early_read_plans_the_cold_starts_early_layers_before_its_last_step_ends():
    planner, elb, cache = planner_with(slots=4)  # initial_chunk=2
    elb.set_tap(0, DeviceStreams(torch.device("cpu")).tap((1, EXPERTS), torch.int32))
    resident_after = {}
    draft_window(planner, elb, 8, on_token=lambda i: resident_after.setdefault(
        i, (cache.resident_experts(0), cache.resident_experts(1))))
    assert resident_after[1] == (set(), set())  # the cold start's first step only observes
    # after step 2: layer 0's counts {0: 2, 1: 1, 2: 1}; the step's other half hides one expert
    assert resident_after[2] == ({0}, set()) and planner.traces[-1].early_batch == 1
    assert resident_after[3] == ({0, 1}, {2})  # then the whole step's plan, as without the early read
    assert cache.resident_experts(0) == {0, 1, 2, 3} and cache.resident_experts(1) == {0, 2, 3, 4}


def test_early_read_waits_for_the_cold_start_and_needs_a_tap():
    planner, elb, cache = planner_with(slots=4, initial_chunk=8)  # no draft-time prefetch
    elb.set_tap(0, DeviceStreams(torch.device("cpu")).tap((1, EXPERTS), torch.int32))
    draft_window(planner, elb, 8)
    assert planner.traces[-1].early_batch == 0 and cache.counters.prefetch_loads == 0
    planner, elb, cache = planner_with(slots=4)
    draft_window(planner, elb, 8)
    assert planner.traces[-1].early_batch == 0


def test_early_read_layer():
    assert early_read_layer(0.25, 26) == 6  # layers 0..6 of dsv2's 26
    assert early_read_layer(0.25, 2) == 0
    assert early_read_layer(0.0, 26) is None and early_read_layer(1.0, 26) is None  # off / the whole step
    assert early_read_layer(0.99, 4) is None


def test_window_shorter_than_the_cold_start_only_plans_verification():
    planner, elb, cache = planner_with(slots=4, initial_chunk=4)
    planner.begin_window(1)
    assert planner.phase == COLD_START
    elb.observe(0, torch.tensor([[1, 2]]))
    planner.after_draft_token(1)
    plan = planner.end_window()
    assert planner.traces[-1].boundaries == [] and cache.counters.prefetch_loads == 0
    assert plan.load_order(0) == [1, 2] and plan.load_order(1) == [] and plan.prefetched == {}


def test_resident_planned_experts_are_not_evicted_by_their_own_batch():
    planner, elb, cache = planner_with(slots=2)
    for expert in (0, 4):  # 0 will be planned, 4 will not; 0 is least recently used
        slot = cache.acquire(0, expert)
        cache.release(0, slot)
    elb.observe(0, torch.tensor([[0, 1]]))
    planner.begin_window(3)
    for drafted in (1, 2, 3):
        planner.after_draft_token(drafted)
    assert cache.resident_experts(0) == {0, 1}


def test_chunk_length_follows_transfer_time():
    cost = CostModel(draft_ms_per_token=2.0, h2d_bytes_per_ms=1000.0, frozen=True)
    assert cost.chunk_tokens(0) == 1 and cost.chunk_tokens(4000) == 2 and cost.chunk_tokens(4001) == 3
    live = CostModel(draft_ms_per_token=2.0)
    live.observe_draft(12.0, 3)
    assert live.draft_ms_per_token == 3.0


def test_a_later_batch_never_evicts_this_windows_earlier_prefetch():
    planner, elb, cache = planner_with(slots=2, initial_chunk=1)
    planner.begin_window(3)
    elb.observe(0, torch.tensor([[1, 2]]))
    planner.after_draft_token(1)  # counters read: plan {1, 2}
    elb.observe(0, torch.tensor([[3, 3]]))
    planner.after_draft_token(2)  # the plan {1, 2} fills layer 0; counters read again: 3 now ranks first
    assert cache.resident_experts(0) == {1, 2}
    elb.observe(0, torch.tensor([[3, 1]]))
    planner.after_draft_token(3)
    planner.end_window()
    assert cache.resident_experts(0) == {1, 2}  # 2 was prefetched for this window: 3 does not evict it
    assert cache.counters.evictions == 0


def test_prefetch_never_evicts_an_expert_the_draft_routed_to():
    planner, elb, cache = planner_with(slots=2, initial_chunk=1)
    for expert in (0, 4):  # 0 least recently used; the draft will route to 0, never to 4
        slot = cache.acquire(0, expert)
        cache.release(0, slot)
    planner.begin_window(3)
    elb.observe(0, torch.tensor([[1, 2], [1, 2], [1, 0]]))  # ranking 1, 2, 0: the plan (top-2) is {1, 2}
    for drafted in (1, 2, 3):
        planner.after_draft_token(drafted)
    assert cache.resident_experts(0) == {0, 1}  # 4 made room for 1; 2 found no slot (0 is predicted)
    assert cache.counters.prefetch_loads == 1 and cache.counters.evictions == 1
