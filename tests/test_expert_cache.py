"""Expert cache: LRU order, protection, event-guarded reuse, counters, victim policies; host store layout."""
import random

import pytest
import torch

from specter.offload.eviction import LookaheadPolicy, LRUPolicy, RoutingCounts, make_policy
from specter.offload.expert_cache import ExpertCache, NoFreeSlot
from specter.offload.host_store import HostExpertStore
from specter.offload.streams import DeviceStreams

LAYERS, EXPERTS, HIDDEN, INTER = 2, 6, 8, 4


def make_cache(slots: int, policy: str = "lru", spare_rows: int = 0, streams=None,
               counts: RoutingCounts | None = None, pooled: bool = False) -> ExpertCache:
    """A cache over a small host store; the popularity policy reads `counts` (new if None)."""
    store = HostExpertStore(LAYERS, EXPERTS, HIDDEN, INTER, torch.float32, torch.device("cpu"))
    for layer in range(LAYERS):
        gate_up = torch.arange(EXPERTS * 2 * INTER * HIDDEN, dtype=torch.float32).view(EXPERTS, 2 * INTER, HIDDEN)
        store.put_layer(layer, gate_up + 1000 * layer, -gate_up[:, :HIDDEN, :INTER] - 1000 * layer)
    streams = streams or DeviceStreams(torch.device("cpu"))
    counts = RoutingCounts() if counts is None else counts
    return ExpertCache(store, slots, torch.device("cpu"), streams, make_policy(policy, counts), spare_rows,
                       pooled=pooled)


class EventLog:
    """Stand-in streams: events are increasing ints; every copy's pool row and the event it waited for."""

    def __init__(self) -> None:
        self.events, self.copies = 0, []  # copies: (row, after)
        self.pool = None

    def record(self) -> int:
        self.events += 1
        return self.events

    def copy(self, dst, src, after=None, demand=False, previous=None) -> int:
        dst.copy_(src)
        self.copies.append(((dst.data_ptr() - self.pool.data_ptr()) // (dst.numel() * dst.element_size()), after))
        return self.record()


def use(cache: ExpertCache, layer: int, expert: int) -> int:
    slot = cache.acquire(layer, expert)
    cache.release(layer, slot)
    return slot


def test_store_rows_are_contiguous_experts():
    cache = make_cache(2)
    gate_up, down = cache.store.split(cache.store.expert(1, 3))
    full_gate_up, full_down = cache.store.layer_weights(1)
    assert torch.equal(gate_up, full_gate_up[3]) and torch.equal(down, full_down[3])
    assert cache.store.expert(1, 3).is_contiguous()
    assert cache.store.expert_bytes == 3 * INTER * HIDDEN * 4


def test_exact_slot_count_and_lru_order():
    cache = make_cache(2)
    assert cache.pool.shape == (LAYERS * 2, cache.store.numel)
    assert make_cache(2, spare_rows=3).pool.shape == (LAYERS * 2 + 3, cache.store.numel)
    use(cache, 0, 0)
    use(cache, 0, 1)
    use(cache, 0, 0)  # hit: expert 1 is now least recently used
    use(cache, 0, 2)
    assert cache.resident_experts(0) == {0, 2}
    assert cache.counters.as_dict() == {"hits": 1, "hits_prefetched": 0, "misses": 3, "misses_planned": 0,
                                        "wasted_loads": 0, "loads_ahead": 0, "prefetch_loads": 0, "evictions": 1,
                                        "reloads_after_prefetch": 0, "reloads_after_ahead": 0,
                                        "reloads_after_verify": 0}
    assert cache.resident_experts(1) == set()


def test_slot_holds_the_experts_weights():
    cache = make_cache(1)
    for expert in (4, 1, 5):
        slot = use(cache, 1, expert)
        got = cache.weights(1, slot)
        want = cache.store.split(cache.store.expert(1, expert))
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_protected_slot_is_never_evicted():
    cache = make_cache(2)
    held = cache.acquire(0, 0)  # protected
    use(cache, 0, 1)
    use(cache, 0, 2)  # must evict expert 1, not the protected expert 0
    assert cache.slot_of(0, 0) == held
    cache.acquire(0, 3)  # takes the other slot and holds it
    with pytest.raises(NoFreeSlot):
        cache.acquire(0, 4)
    assert not cache.prefetch(0, 4)


@pytest.mark.parametrize("spare_rows", [0, 2])
def test_randomized_plans_and_demands_never_evict_protected(spare_rows):
    rng = random.Random(0)
    for policy in ("lru", "lookahead", "popularity"):
        counts = RoutingCounts({layer: [rng.randrange(9) for _ in range(EXPERTS)] for layer in range(LAYERS)})
        cache = make_cache(3, policy, spare_rows, counts=counts)
        held: list[tuple[int, int, int]] = []  # (layer, expert, slot)
        for _ in range(2000):
            layer, expert = rng.randrange(LAYERS), rng.randrange(EXPERTS)
            op = rng.random()
            protected = {(lay, s): e for lay, e, s in held}
            if op < 0.3:
                cache.prefetch(layer, expert, predicted=frozenset(rng.sample(range(EXPERTS), 2)))
            elif op < 0.7 and sum(1 for lay, _, _ in held if lay == layer) < 3:
                try:
                    slot = cache.acquire(layer, expert)
                except NoFreeSlot:
                    continue
                held.append((layer, expert, slot))
            elif held:
                lay, e, s = held.pop(rng.randrange(len(held)))
                cache.release(lay, s)
            for (lay, s), e in protected.items():
                assert cache.layers[lay].expert_of[s] == e, "a protected slot was overwritten"
            for lay, e, s in held:
                want = cache.store.split(cache.store.expert(lay, e))[0]
                assert torch.equal(cache.weights(lay, s)[0], want)


def test_lookahead_policy_keeps_predicted_experts():
    cache = make_cache(2)
    use(cache, 0, 0)
    use(cache, 0, 1)  # expert 0 is least recently used
    slots, predicted = cache.layers[0], frozenset({0})  # the draft predicts expert 0
    assert slots.expert_of[LRUPolicy().victim(0, slots, predicted=predicted)] == 0
    assert slots.expert_of[LookaheadPolicy().victim(0, slots, predicted=predicted)] == 1
    everything = frozenset({0, 1})  # no other slot will do: the least recently used after all
    assert slots.expert_of[LookaheadPolicy().victim(0, slots, predicted=everything)] == 0


def test_popularity_policy_evicts_the_least_routed_expert_lru_among_ties():
    counts = RoutingCounts()
    cache = make_cache(3, "popularity", counts=counts)
    for expert in (0, 1, 2):
        use(cache, 0, expert)
    counts.by_layer[0] = [5, 1, 1, 0, 0, 0]  # experts 1 and 2 tie; 1 is less recently used
    use(cache, 0, 3)
    assert cache.resident_experts(0) == {0, 2, 3}
    use(cache, 0, 4)  # expert 3 (count 0) goes now, though 0 is the least recently used
    assert cache.resident_experts(0) == {0, 2, 4}
    counts.clear()  # a new request: no counts, so plain LRU, and the policy still reads the same counts
    assert cache.policy.counts is counts and counts.get(0) is None
    use(cache, 0, 5)
    assert cache.resident_experts(0) == {2, 4, 5}


def test_popularity_streams_into_the_earliest_released_slots_least_routed_first():
    cache = make_cache(4, "popularity", counts=RoutingCounts({0: [5, 2, 1, 0, 0, 0]}))
    for expert in (0, 1, 2, 3):
        use(cache, 0, expert)
    slot = cache.protect_resident(0)  # expert -> slot, all protected, as a verify layer starts
    cache.release_all(0, [slot[0], slot[1]])  # the first wave
    cache.release_all(0, [slot[2], slot[3]])  # the second, still computing when the copies are issued
    assert cache.policy.victim(0, cache.layers[0]) == slot[3]  # a prefetch or load ahead: the least routed
    assert cache.load_if_free(0, 4) == slot[1]  # streamed: least routed of the first wave, not expert 3
    assert cache.load_if_free(0, 5) == slot[0]  # the first wave's last slot before any of the second's
    assert cache.load_if_free(0, 1) == slot[3]  # then the second wave's, least routed first


def test_a_prefetch_evicts_the_least_recently_used_expert_it_need_not_keep():
    cache = make_cache(3)
    assert cache.prefetch(0, 0)  # window 1: a prefetch nobody reads
    use(cache, 0, 1)  # window 1's verification reads 1 (a miss)
    cache.begin_window()  # window 2: 2 is prefetched, and verification reads it among the residents
    assert cache.prefetch(0, 2)
    resident = cache.protect_resident(0)
    cache.count_lookups(0, [2], resident, set(), {2})
    cache.release_all(0, list(resident.values()))
    cache.begin_window()  # window 3
    assert cache.prefetch(0, 3)  # evicts 0 (least recently used)
    assert cache.prefetch(0, 4) and cache.resident_experts(0) == {2, 3, 4}  # then 1
    assert cache.prefetch(0, 5, keep=frozenset({3, 4}))  # 2 goes: the prefetched 3, 4 are planned
    assert cache.resident_experts(0) == {3, 4, 5}
    assert not cache.prefetch(0, 1, keep=frozenset({3, 4, 5}))  # every slot kept: nothing evicted
    assert cache.resident_experts(0) == {3, 4, 5}


def test_prefetch_then_hit_is_counted_as_prefetched():
    cache = make_cache(2)
    assert cache.prefetch(0, 5)
    use(cache, 0, 5)
    use(cache, 0, 5)
    assert cache.counters.hits == 2 and cache.counters.hits_prefetched == 1
    assert cache.counters.prefetch_loads == 1 and cache.counters.misses == 0
    stats = cache.streams.stats()
    assert stats["h2d_copies"] == 1 and stats["h2d_bytes"] == cache.store.expert_bytes


def test_reset_empties_every_slot():
    cache = make_cache(2)
    use(cache, 0, 1)
    cache.reset()
    assert cache.resident_experts(0) == set() and cache.counters.misses == 0


def test_reloads_are_counted_by_what_evicted_the_expert_in_the_same_window():
    cache = make_cache(1)
    use(cache, 0, 0)
    cache.begin_window()
    assert cache.prefetch(0, 1)  # evicts expert 0 (nothing predicted or planned keeps it)
    use(cache, 0, 0)  # verification needs 0 again: a reload caused by the prefetch
    assert cache.load_ahead(1, 2, frozenset()) and cache.load_ahead(1, 3, frozenset())  # 3 evicts 2
    use(cache, 1, 2)
    assert (cache.counters.reloads_after_prefetch, cache.counters.reloads_after_ahead) == (1, 1)
    cache.begin_window()  # an eviction of an earlier window is not a reload of this one
    use(cache, 0, 1)
    assert cache.counters.reloads_after_verify == 0 and cache.counters.evictions == 5


def test_a_load_takes_the_oldest_spare_row_and_its_victims_row_becomes_spare():
    cache = make_cache(1, spare_rows=2)  # rows: layer 0 slot 0 = 0, layer 1 slot 0 = 1, spares 2 and 3
    assert [cache.row(0, 0), cache.row(1, 0)] == [0, 1] and [r.row for r in cache.spares] == [2, 3]
    use(cache, 0, 4)
    assert cache.row(0, 0) == 2 and [r.row for r in cache.spares] == [3, 0]
    use(cache, 1, 5)
    assert cache.row(1, 0) == 3 and [r.row for r in cache.spares] == [0, 1]
    use(cache, 0, 1)  # evicts expert 4 (row 2): row 2 waits as a spare behind rows 0 and 1
    assert cache.row(0, 0) == 0 and [r.row for r in cache.spares] == [1, 2]
    assert torch.equal(cache.weights(0, 0)[0], cache.store.split(cache.store.expert(0, 1))[0])
    cache.reset()
    assert [cache.row(0, 0), cache.row(1, 0)] == [0, 1] and [r.row for r in cache.spares] == [2, 3]


@pytest.mark.parametrize("spare_rows", [0, 1, 3])
def test_every_copy_waits_for_the_last_reader_of_the_row_it_writes(spare_rows):
    """A randomized stress of loads, prefetches and releases: each copy waits for the last launch that read
    the pool row it overwrites (with spares, that is not its victim's row), and every row belongs to
    exactly one slot or spare."""
    rng, log = random.Random(1), EventLog()
    cache = make_cache(2, "lru", spare_rows, streams=log)
    log.pool = cache.pool
    last_reader: dict[int, int] = {}  # pool row -> event of the last release that read it
    held: list[tuple[int, int]] = []  # (layer, slot)
    for _ in range(1500):
        layer, expert = rng.randrange(LAYERS), rng.randrange(EXPERTS)
        copies = len(log.copies)
        if rng.random() < 0.3:
            cache.prefetch(layer, expert)
        elif rng.random() < 0.6 and sum(1 for lay, _ in held if lay == layer) < 2:
            held.append((layer, cache.acquire(layer, expert)))
        elif held:
            lay, slot = held.pop(rng.randrange(len(held)))
            row = cache.row(lay, slot)
            cache.release(lay, slot)
            last_reader[row] = log.events
        for row, after in log.copies[copies:]:
            assert after == last_reader.get(row), f"a copy into row {row} did not wait for its last reader"
        rows = [cache.row(lay, s) for lay in range(LAYERS) for s in range(2)] + [r.row for r in cache.spares]
        assert sorted(rows) == list(range(LAYERS * 2 + spare_rows))


def owned_rows(cache: ExpertCache) -> list[int]:
    """Every pool row a slot or the spares hold, sorted (each must appear once)."""
    rows = [row for slots in cache.layers for row in slots.rows if row is not None]
    return sorted(rows + [spare.row for spare in cache.spares])


@pytest.mark.parametrize("spare_rows", [1, 3])
def test_spare_slots_lend_rows_to_a_verify_layer_and_take_them_back(spare_rows):
    """Pooled slots: streamed loads fill the rowless slots while spares last (then the layer's own
    victims), each copy still waits for the last reader of its row, every row keeps one owner, and giving the lent rows
    back leaves the layer its own slot count, the most recently used experts kept."""
    rng, log = random.Random(spare_rows), EventLog()
    cache = make_cache(2, "lru", spare_rows, streams=log, pooled=True)
    log.pool = cache.pool
    assert cache.stream_slots == 2 + spare_rows and cache.pool.shape[0] == LAYERS * 2 + spare_rows
    last_reader: dict[int, int] = {}
    for _ in range(300):
        layer = rng.randrange(LAYERS)
        copies, held = len(log.copies), []
        for expert in rng.sample(range(EXPERTS), rng.randint(1, EXPERTS)):
            if cache.slot_of(layer, expert) is None:
                slot = cache.load_if_free(layer, expert)
                if slot is None:
                    break
                held.append(slot)
        assert len(held) <= cache.stream_slots
        for row, after in log.copies[copies:]:
            assert after == last_reader.get(row), f"a copy into row {row} did not wait for its last reader"
        assert owned_rows(cache) == list(range(LAYERS * 2 + spare_rows))
        for slot in held:
            row = cache.row(layer, slot)
            cache.release(layer, slot)
            last_reader[row] = log.events
        recent = [cache.layers[layer].expert_of[s] for s in list(cache.layers[layer].lru)[-2:]]
        cache.return_lent_rows(layer)
        assert sum(row is not None for row in cache.layers[layer].rows) <= 2 and len(cache.spares) == spare_rows
        assert {e for e in recent if e is not None} <= cache.resident_experts(layer)
        assert owned_rows(cache) == list(range(LAYERS * 2 + spare_rows))
        if rng.random() < 0.3:
            cache.prefetch(rng.randrange(LAYERS), rng.randrange(EXPERTS))  # own slots only: no spare lent
            assert len(cache.spares) == spare_rows


def test_without_spare_slots_a_layer_never_holds_more_than_its_slots():
    cache = make_cache(2, spare_rows=3)
    assert cache.stream_slots == 2 and [slots.size for slots in cache.layers] == [2, 2]
    assert [cache.load_if_free(0, e) for e in range(3)] == [0, 1, None]
    cache.return_lent_rows(0)  # nothing lent: no-op
    assert cache.resident_experts(0) == {0, 1} and len(cache.spares) == 3
