"""Residency manager under random plans: right or wrong verification plans never change the layer's output."""
import random
from types import SimpleNamespace

import pytest
import torch

from specter.kernels.moe_align import MoEWorkspace
from specter.kernels.reference import expert_wise_moe
from specter.offload.eviction import LRUPolicy, RoutingCounts
from specter.offload.expert_cache import ExpertCache
from specter.offload.host_store import HostExpertStore
from specter.offload.streams import DeviceStreams
from specter.prefetch.lookahead import Ranking
from specter.prefetch.planner import WindowPlan
from specter.verify.residency import ResidencyManager, VerifyOptions, wave_size

LAYERS, EXPERTS, HIDDEN, INTER, TOP_K = 3, 8, 16, 8, 2


def make_runtime(slots: int, seed: int, spare_rows: int = 0, pooled: bool = False,
                 **options) -> tuple[ResidencyManager, HostExpertStore]:
    """A residency manager over a random host store (LRU; no spare rows unless asked), with VerifyOptions(**options)."""
    gen = torch.Generator().manual_seed(seed)
    store = HostExpertStore(LAYERS, EXPERTS, HIDDEN, INTER, torch.float32, torch.device("cpu"))
    for layer in range(LAYERS):
        store.put_layer(layer, torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen),
                        torch.randn(EXPERTS, HIDDEN, INTER, generator=gen))
    cache = ExpertCache(store, slots, torch.device("cpu"), DeviceStreams(torch.device("cpu")), LRUPolicy(), spare_rows,
                        pooled=pooled)
    return ResidencyManager(cache, RoutingCounts(), VerifyOptions(**options), MoEWorkspace()), store


def plan_of(experts: dict[int, list[int]]) -> WindowPlan:
    """A window's plan whose verification loads `experts` (layer -> experts, in this order)."""
    return WindowPlan({}, Ranking.of(experts))


def layer_module(layer: int) -> SimpleNamespace:
    return SimpleNamespace(moe_layer=layer, num_experts=EXPERTS, intermediate_dim=INTER,
                           act_fn=torch.nn.functional.silu)


def random_plan(rng: random.Random, routed: set) -> list[int]:
    """A plan that is right, partial, padded with wrong experts, or entirely wrong."""
    kind = rng.choice(["exact", "partial", "padded", "wrong", "empty"])
    others = sorted(set(range(EXPERTS)) - routed)
    plan = {"exact": routed, "partial": set(rng.sample(sorted(routed), len(routed) // 2)),
            "padded": routed | set(rng.sample(others, min(2, len(others)))),
            "wrong": set(rng.sample(others, min(3, len(others)))), "empty": set()}[kind]
    return rng.sample(sorted(plan), len(plan))  # any order


@pytest.mark.parametrize("slots", [1, 2, 5])
def test_random_plans_give_the_reference_output_and_consistent_counters(slots):
    rng, manager, store = random.Random(slots), *make_runtime(slots, seed=slots)
    cache = manager.cache
    torch.manual_seed(slots)
    for _ in range(40):
        tokens = rng.randint(1, 6)
        hidden = torch.randn(tokens, HIDDEN)
        routing = [torch.stack([torch.randperm(EXPERTS)[:TOP_K] for _ in range(tokens)]) for _ in range(LAYERS)]
        weights = torch.rand(tokens, TOP_K).softmax(-1)
        plan = plan_of({layer: random_plan(rng, set(routing[layer].reshape(-1).tolist())) for layer in range(LAYERS)})
        verify = manager.window(plan)
        for layer in range(LAYERS):
            before = cache.counters.as_dict()
            out = verify(layer_module(layer), hidden, routing[layer], weights)
            weights_of = lambda e, layer=layer: store.split(store.expert(layer, e))  # noqa: E731
            ref = expert_wise_moe(hidden, routing[layer], weights, weights_of, EXPERTS, torch.nn.functional.silu)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            delta = {key: cache.counters.as_dict()[key] - before[key] for key in before}
            assert delta["hits"] + delta["misses"] == len(set(routing[layer].reshape(-1).tolist()))
            assert all(p == 0 for p in cache.layers[layer].protected)  # every slot released
        manager.take_demand()
    copies = cache.streams.stats()["h2d_copies"]
    assert copies == cache.counters.misses + cache.counters.wasted_loads  # each copy: a miss or a wrong guess
    assert cache.counters.loads_ahead > 0 or slots == 1


@pytest.mark.parametrize("wave", [0, -1])
@pytest.mark.parametrize("slots, spare_rows", [(1, 3), (2, 2)])
def test_spare_slots_stream_wider_waves_with_the_reference_output(slots, spare_rows, wave):
    """Pooled slots: waves of half (0) or all (-1, what pooled slots run) of slots + spare rows, every
    output the reference's, every slot released, and each layer back to its own slots (the lent rows with the
    spares) once it is done."""
    rng, (manager, store) = random.Random(7), make_runtime(slots, 7, spare_rows, pooled=True, wave=wave)
    cache, sizes = manager.cache, []
    run_wave = manager._run_wave
    manager._run_wave = lambda step, wave: (sizes.append(len(wave)), run_wave(step, wave))
    for _ in range(20):
        tokens = rng.randint(2, 6)
        hidden, weights = torch.randn(tokens, HIDDEN), torch.rand(tokens, TOP_K).softmax(-1)
        routing = [torch.stack([torch.randperm(EXPERTS)[:TOP_K] for _ in range(tokens)]) for _ in range(LAYERS)]
        plan = plan_of({layer: random_plan(rng, set(routing[layer].reshape(-1).tolist())) for layer in range(LAYERS)})
        verify = manager.window(plan)
        for layer in range(LAYERS):
            out = verify(layer_module(layer), hidden, routing[layer], weights)
            weights_of = lambda e, layer=layer: store.split(store.expert(layer, e))  # noqa: E731
            ref = expert_wise_moe(hidden, routing[layer], weights, weights_of, EXPERTS, torch.nn.functional.silu)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            slots_of = cache.layers[layer]
            assert all(p == 0 for p in slots_of.protected)
            assert sum(row is not None for row in slots_of.rows) <= slots
    assert max(sizes) == wave_size(wave, slots + spare_rows) and len(cache.spares) <= spare_rows


def test_waves_are_half_the_slots_and_freed_slots_load_before_the_next_wave():
    manager, _ = make_runtime(slots=4, seed=0)
    cache, events = manager.cache, []
    for expert in (0, 1, 2, 3):  # resident at the start
        cache.release(0, cache.acquire(0, expert))
    run_wave, load = manager._run_wave, cache.load
    manager._run_wave = lambda step, wave: (events.append(("run", [e for e, _ in wave])), run_wave(step, wave))
    cache.load = lambda layer, expert, slot=None: (events.append(("load", expert)), load(layer, expert, slot))[1]
    routing = torch.tensor([[0, 4], [1, 5], [2, 6], [3, 7]])  # [T, k]: every expert once
    verify = manager.window(plan_of({0: [4, 5, 6, 7]}))
    verify(layer_module(0), torch.randn(4, HIDDEN), routing, torch.full((4, 2), 0.5))
    assert events == [("run", [0, 1]), ("load", 4), ("load", 5), ("run", [2, 3]), ("load", 6), ("load", 7),
                      ("run", [4, 5]), ("run", [6, 7])]


def test_a_wave_never_mixes_loaded_experts_with_ones_loaded_ahead():
    manager, _ = make_runtime(slots=4, seed=0, wave=4)
    cache, runs = manager.cache, []
    for expert in (0, 1):  # resident before the layer
        cache.release(0, cache.acquire(0, expert))
    verify = manager.window(plan_of({0: [0, 1, 2, 3, 4]}))
    manager._load_ahead(0, verify.plan)  # as the previous layer does: 2 and 3 go into the free slots, still in flight
    assert manager.loaded_ahead == {0: {2, 3}}
    run_wave = manager._run_wave
    manager._run_wave = lambda step, wave: (runs.append(sorted(e for e, _ in wave)), run_wave(step, wave))
    routing = torch.tensor([[0, 4], [1, 2], [3, 4]])  # [T, k]
    verify(layer_module(0), torch.randn(3, HIDDEN), routing, torch.full((3, 2), 0.5))
    assert runs == [[0, 1], [2, 3, 4]]  # not [0, 1, 2, 3]: the loaded pair does not wait for the copies


@pytest.mark.parametrize("wave, ahead", [(1, 0), (3, 2), (-1, 1)])
def test_wave_size_and_layers_ahead_are_options(wave, ahead):
    manager, _ = make_runtime(slots=4, seed=1, wave=wave, ahead_layers=ahead)
    cache, sizes = manager.cache, []
    run_wave = manager._run_wave
    manager._run_wave = lambda step, w: (sizes.append(len(w)), run_wave(step, w))
    routing = torch.tensor([[4, 5], [6, 7]])
    verify = manager.window(plan_of({layer: [4, 5, 6, 7] for layer in range(LAYERS)}))  # none of it resident yet
    verify(layer_module(0), torch.randn(2, HIDDEN), routing, torch.full((2, 2), 0.5))
    assert max(sizes) == (wave if wave > 0 else 4)  # -1: every one of the 4 slots
    assert sorted(manager.loaded_ahead) == list(range(1, 1 + ahead))  # layers 1..ahead started their plans
    assert cache.counters.loads_ahead == 4 * ahead
    assert not hasattr(manager, "plan")  # the plan is the window's executor's only (PlannedVerify)


def test_a_wave_row_map_holds_each_wave_expert_row_and_minus_one_elsewhere():
    streams = DeviceStreams(torch.device("cpu"))
    row_map = streams.upload_map(6, [(3, 0), (1, 5)])
    assert row_map.dtype == torch.long and row_map.tolist() == [-1, 5, -1, 0, -1, -1]
    assert streams.upload_map(6, [(2, 4)]).tolist() == [-1, -1, 4, -1, -1, -1]  # nothing of the last map stays


@pytest.mark.parametrize("option, slots, size", [(0, 4, 2), (0, 1, 1), (0, 16, 8), (3, 16, 3), (-1, 4, 4), (-1, 16, 16)])
def test_wave_size_is_the_option_half_the_slots_or_every_slot(option, slots, size):
    assert wave_size(option, slots) == size


def test_deferred_loads_start_before_the_router_wait_and_after_the_loads_ahead():
    """With grouped copies (residual transfer) nothing a layer loaded may wait for its group while the host launches
    waves, waits for the router or runs the next layer's attention: the manager starts the loads after each batch
    of loads into released slots, before the router wait and after the loads ahead."""
    manager, _ = make_runtime(slots=4, seed=0, ahead_layers=1)
    cache, events = manager.cache, []
    run_wave, load_ahead, start = manager._run_wave, cache.load_ahead, cache.start_loads
    manager._run_wave = lambda step, wave: (events.append("wave"), run_wave(step, wave))
    cache.load_ahead = lambda *args: (events.append("ahead"), load_ahead(*args))[1]
    cache.start_loads = lambda: (events.append("start"), start())
    routing = torch.tensor([[4, 5], [6, 7]])
    verify = manager.window(plan_of({layer: [4, 5, 6, 7] for layer in range(LAYERS)}))
    verify(layer_module(0), torch.randn(2, HIDDEN), routing, torch.full((2, 2), 0.5))
    assert events == ["start", "wave", "wave", "start", "ahead", "ahead", "ahead", "ahead", "start"]


def test_token_wise_verification_stacks_its_rows_once_per_layer():
    """One GEMV per (token, expert) pair, their rows stacked in one cat: no row write per pair."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    manager, store = make_runtime(EXPERTS, seed=3, expert_wise=False)
    hidden, routing = torch.randn(5, HIDDEN), torch.stack([torch.randperm(EXPERTS)[:TOP_K] for _ in range(5)])
    weights = torch.rand(5, TOP_K).softmax(-1)
    verify = manager.window(None)
    verify(layer_module(0), hidden, routing, weights)  # every routed expert loads once
    with Ops() as ops:
        out = verify(layer_module(0), hidden, routing, weights)  # all resident: no copy at all
    weights_of = lambda e: store.split(store.expert(0, e))  # noqa: E731
    ref = expert_wise_moe(hidden, routing, weights, weights_of, EXPERTS, torch.nn.functional.silu)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert ops.calls["cat"] == 1 and ops.calls["copy_"] == 0 and ops.calls["index_put_"] == 0, ops.calls
