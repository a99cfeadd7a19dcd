"""SpecMoEOff baseline: lossless greedy, a draft sharing nothing with the target, K optimizer, SM slots, prefetch."""
import pytest
import torch

import specter
from baselines.specmoeoff import SpecMoEOff, SpecMoEOffConfig, make_specmoeoff_sc, make_specmoeoff_sm
from baselines.specmoeoff.draft_model import draft_tensors
from baselines.specmoeoff.windows import OneRequest
from baselines.specmoeoff.k_optimizer import CostModel, best_k, expected_distinct, expected_tokens, time_per_token
from baselines.specmoeoff.memory_policy import draft_copy_bytes, matched_memory_slots
from baselines.target_only import TargetOnly
from experiments.systems import build_system
from specter.metrics import DecodeMetrics
from specter.models.loading import hf_config
from specter.models.registry import get_spec
from specter.device.budget import MemoryPlan, plan_memory
from tests.conftest import prompt, tiny_model

NEW = 20
HIGH = specter.SpecterConfig(k=4, resident_experts_per_layer=4)


def fresh(name: str) -> specter.HybridMoEModel:
    """Offloading moves the experts out of the model: these tests never offload the shared cached models."""
    return specter.load_model(name, device="cpu", dtype=torch.float32)


def reference(name: str, ids: torch.Tensor, new: int = NEW) -> list[int]:
    return TargetOnly(tiny_model(name)).generate(ids, new).token_ids  # all experts resident, never offloaded


def storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_greedy_equals_target_only_same_cache_and_matched_memory(tiny_name):
    model, ids = fresh(tiny_name), prompt()
    sc, sm = make_specmoeoff_sc(model, HIGH), make_specmoeoff_sm(model, HIGH)
    assert (sc.config.slots, sm.config.slots) == (4, 1)  # tiny: the draft copy costs more than 3 slots a layer
    want = reference(tiny_name, ids)
    for system in (sc, sm):
        out = system.generate(ids, NEW)
        assert out.token_ids == want, (tiny_name, system.name)
        assert out.stats["resident_experts_per_layer"] == system.config.slots and out.stats["misses"] > 0
        assert len(out.stats["k_per_window"]) == out.stats["iterations"]


def test_draft_and_target_share_no_weights_and_no_kv():
    model, ids = fresh("tiny-dsv2"), prompt()
    system = make_specmoeoff_sc(model, HIGH, fixed_k=3)
    draft = system.draft_model
    assert torch.equal(draft.forward(ids, None), model.forward(ids, None, "draft"))  # the same draft, a copy
    call = system.begin_request(system.session())
    target_state, draft_state = system.prefill(call, ids, NEW)
    request = OneRequest(system, call, target_state, draft_state, DecodeMetrics(model.device), NEW)
    drafted, plan = request.draft(3)
    request.commit(3, request.verify(drafted, call.verifier(plan)))
    runtime = model.offload
    target = [*model.hf.parameters(), *model.hf.buffers(), runtime.cache.pool, *runtime.store.buffers]
    assert not storages(draft_tensors(draft)) & storages(target)
    assert draft_state.cache is not target_state.cache
    kv, draft_kv = ([t for layer in state.cache.layers for t in (layer.keys, layer.values)]
                    for state in (target_state, draft_state))
    assert not storages(draft_kv) & storages(kv)
    assert draft_state.tokens == target_state.tokens  # both commit the same sequence


def test_k_optimizer_with_numbers():
    assert expected_tokens(0.5, 3) == pytest.approx(1.875) and expected_tokens(1.0, 4) == 5
    assert expected_distinct(1, 64, 6) == pytest.approx(6) and expected_distinct(100, 64, 6) == pytest.approx(64, 1e-3)
    dsv2 = {"layers": 26, "experts": 64, "top_k": 6, "draft_ms": 10, "verify_pass_ms": 40, "verify_token_ms": 5,
            "load_ms": 0.35, "load_factor": 0.5}  # ~H200: 17 MB experts at ~50 GB/s, half of a window's experts miss
    ks = [best_k(CostModel(**dsv2, alpha=a), 32) for a in (0.1, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0)]
    assert ks == sorted(ks) and ks[0] == ks[1] == 1 and ks[-2] == ks[-1] == 32
    costs = CostModel(**dsv2, alpha=0.9)
    assert time_per_token(costs, best_k(costs, 32)) < min(time_per_token(costs, 1), time_per_token(costs, 32))
    dear_pass = CostModel(**{**dsv2, "verify_pass_ms": 200}, alpha=0.9)  # more to amortise: longer windows
    assert best_k(dear_pass, 32) > best_k(costs, 32)


def test_k_optimizer_learns_from_windows():
    costs = CostModel(layers=3, experts=8, top_k=2, alpha=0.5, verify_pass_ms=1.0, load_ms=0.0)
    for n in (16, 3, 5, 2, 9):  # exact line c = 7 + 2n: the fit recovers it
        costs.observe_verify(n, 7 + 2 * n, loads=0)
    assert costs.verify_pass_ms == pytest.approx(7) and costs.verify_token_ms == pytest.approx(2)
    before = best_k(costs, 32)
    for _ in range(12):  # every draft accepted
        costs.observe(4, 4, window_ms=4 * costs.draft_ms + 7 + 2 * 5, loads=0, draft_ms=costs.draft_ms)
    assert costs.alpha > 0.98 and best_k(costs, 32) > before
    assert costs.verify_pass_ms == pytest.approx(7) and costs.verify_token_ms == pytest.approx(2)


def test_matched_memory_slot_arithmetic():
    plan = MemoryPlan(non_expert_bytes=1000, draft_bytes=400, kv_bytes=200, workspace_bytes=50, expert_bytes=100,
                      num_moe_layers=2, num_experts=16)  # one slot in every layer: 200 bytes
    assert draft_copy_bytes(plan) == 1600
    assert matched_memory_slots(plan, 10) == 10 + (400 - 1600) // 200 == 4
    assert matched_memory_slots(plan, 5) == 1  # at least one slot
    dsv2 = plan_memory(get_spec("dsv2"), hf_config(get_spec("dsv2")), torch.float16)
    slots = matched_memory_slots(dsv2, 16)
    specmoeoff_bytes = [dsv2.bytes_for(s) + draft_copy_bytes(dsv2) - dsv2.draft_bytes for s in (slots, slots + 1)]
    assert specmoeoff_bytes[0] <= dsv2.bytes_for(16) < specmoeoff_bytes[1]  # the most slots that fit Specter's bytes
    assert 1 <= slots < 16


@pytest.mark.parametrize("positions", [(2,), (1, 3)])
def test_prefetch_runs_at_the_configured_draft_steps(positions):
    model = fresh("tiny-qwen")
    system = SpecMoEOff(model, SpecMoEOffConfig(slots=2, fixed_k=4, prefetch_at=positions))
    out = system.generate(prompt(), NEW)
    traces = out.stats["prefetch_trace"]
    assert len(traces) == sum(1 for k in out.stats["k_per_window"] if k)
    for trace in traces:
        assert trace["boundaries"] == [p for p in positions if p <= trace["k"]] and set(trace["phases"]) <= {"fixed"}
    assert out.stats["prefetch_loads"] == sum(sum(t["batches"]) for t in traces) > 0
    assert out.token_ids == reference("tiny-qwen", prompt())


def test_systems_sharing_one_model_stay_lossless():
    model, ids = fresh("tiny-mixtral"), prompt()
    want = reference("tiny-mixtral", ids)
    specmoeoff = build_system("specmoeoff_sm", model, HIGH)
    assert specmoeoff.name == "specmoeoff_sm" and specmoeoff.available() == (True, "")
    for system in (specmoeoff, specter.SpecterEngine(model, HIGH), TargetOnly(model, 4), specmoeoff):
        assert system.generate(ids, NEW).token_ids == want, system.name


def test_sampling_runs_and_counts():
    model = fresh("tiny-phi")
    sampled = specter.SpecterConfig(k=4, resident_experts_per_layer=2, temperature=1.0, seed=3)
    system = make_specmoeoff_sc(model, sampled, fixed_k=3)
    first, second = system.generate(prompt(), 12), system.generate(prompt(), 12)
    assert len(first.token_ids) == 12 and first.token_ids == second.token_ids  # seeded per request
    assert 0 <= first.stats["acceptance_rate"] <= 1


class TurnTaker:
    """A stand-in microbatch: tokens each request still needs, spent one window at a time."""

    def __init__(self, left: list[int], new: int) -> None:
        self.left, self.new = left, new
        self.target = type("Target", (), {"generated": lambda _, r: [0] * (new - self.left[r])})()

    def active(self, max_new_tokens: int) -> list[bool]:
        return [n > 0 for n in self.left]


def test_microbatches_take_turns_skipping_those_done():
    """The window loop visits the microbatches in turn, a done one skipped, as rounds over them would; K is the
    cost model's, at most what the neediest active request has left (- 1), at least 1."""
    from baselines.specmoeoff.microbatch import TakingTurns
    new = 10
    micro = [TurnTaker([4], new), TurnTaker([10, 2], new)]
    engine = type("Engine", (), {"choose_k": lambda self: 5})()
    turns, ks = TakingTurns(engine, None, micro, new), []
    order = []
    while (k := turns.next_window()) is not None:
        order.append(turns.turn)
        ks.append(k)
        m = micro[turns.turn]
        m.left = [max(0, n - (k + 1)) for n in m.left]  # a fully accepted window
    assert order == [0, 1, 1]  # microbatch 0 is done after one window (k = 3: its 4 tokens)
    assert ks == [3, 5, 3]
