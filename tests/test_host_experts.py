"""Cold experts on the CPU during verification: the split between the paths, and lossless decoding with it."""
import pytest
import torch

import specter
import specter.verify.host_experts as host_experts_module
from specter.verify.host_experts import HostCost, measure_host_cost, split_for_host
from tests.conftest import hf_greedy, prompt

NEW = 32


def test_the_host_takes_the_fewest_token_experts_while_it_keeps_up_with_the_copies():
    cost = HostCost(fixed_ms=0.2, per_token_ms=0.1)  # 1 token: 0.3 ms, 4 tokens: 0.6 ms
    candidates = [(7, 4), (3, 1), (5, 1), (9, 12)]
    # copies of 0.5 ms each: host 3 (0.3) leaves 1.5 ms of copies; host 5 (0.6 in all) leaves 1.0; host 7
    # (1.2 in all) would exceed the 0.5 ms left
    assert split_for_host(candidates, cost, copy_ms=0.5) == {3, 5}
    assert split_for_host(candidates, cost, copy_ms=0.1) == {3}  # 0.3 ms on the host while 3 copies take 0.3
    assert split_for_host(candidates, cost, copy_ms=0.05) == set()  # the copies are faster
    assert split_for_host(candidates, HostCost(0.0, 0.0), copy_ms=0.5) == {3, 5, 7, 9}
    assert split_for_host([], cost, copy_ms=0.5) == set()


def test_the_measured_cost_grows_with_tokens():
    model = specter.load_model("tiny", device="cpu", dtype=torch.float32)
    runtime = specter.SpecterEngine(model, specter.SpecterConfig(k=2, resident_experts_per_layer=1)).model.offload
    cost = measure_host_cost(runtime.store, model.experts[0].act_fn)
    assert cost.fixed_ms >= 0 and cost.per_token_ms >= 0 and cost.cpu_ms(16) >= cost.cpu_ms(1) > 0


def test_the_cost_is_measured_on_cold_experts(monkeypatch):
    """Every timed call reads another expert's weights, as a cold expert's come from memory in a run."""
    model = specter.load_model("tiny", device="cpu", dtype=torch.float32)
    store = specter.SpecterEngine(model, specter.SpecterConfig(k=2, resident_experts_per_layer=1)).model.offload.store
    read, expert = [], store.expert
    monkeypatch.setattr(store, "expert", lambda layer, e: read.append((layer, e)) or expert(layer, e))
    measure_host_cost(store, model.experts[0].act_fn, repeats=3)
    assert len(read) == 8 and len(set(read)) == 8 and store.num_layers * store.num_experts >= 8
    assert {layer for layer, _ in read} == set(range(store.num_layers))  # spread over the layers


@pytest.mark.parametrize("layers,experts,count", [(4, 8, 8), (2, 3, 6), (1, 1, 3), (3, 4, 5)])
def test_cold_experts_are_distinct_while_the_store_has_enough(layers, experts, count):
    class Store:
        num_layers, num_experts = layers, experts

    pairs = list(host_experts_module.cold_experts(Store, count))
    assert len(pairs) == count and all(0 <= layer < layers and 0 <= e < experts for layer, e in pairs)
    assert len(set(pairs)) == min(count, layers * experts)


def test_the_runner_sets_torch_threads_in_its_worker_only():
    from specter.verify.host_experts import HostExpertRunner

    main_threads = torch.get_num_threads()
    runner = HostExpertRunner(None, HostCost(1.0, 0.0), threads=1)
    default = HostExpertRunner(None, HostCost(1.0, 0.0))
    try:
        assert runner.pool.submit(torch.get_num_threads).result() == 1 and runner.threads == 1
        assert default.pool.submit(torch.get_num_threads).result() == main_threads
        assert torch.get_num_threads() == main_threads
    finally:
        runner.close()
        default.close()


def test_a_system_asking_other_host_threads_gets_a_new_runner(free_host):
    model = specter.load_model("tiny", device="cpu", dtype=torch.float32)
    for threads in (1, 0):
        config = specter.SpecterConfig(k=2, resident_experts_per_layer=2, host_experts=True,
                                       host_expert_threads=threads)
        specter.SpecterEngine(model, config).generate(prompt(), 8)
        runner = model.offload.host_runner
        assert runner.threads == threads
        assert runner.pool.submit(torch.get_num_threads).result() == (threads or torch.get_num_threads())


def test_the_runner_measures_its_cost_in_its_own_worker_thread(monkeypatch):
    """The start-up estimate is taken where the experts run: the worker thread, in inference mode."""
    import threading

    from specter.verify.host_experts import HostExpertRunner

    seen = []
    monkeypatch.setattr(host_experts_module, "measure_host_cost", lambda store, act: seen.append(
        (threading.current_thread().name, torch.is_inference_mode_enabled(), act)) or HostCost(1.0, 0.5))
    runner = HostExpertRunner(store=None, act="act")
    runner.close()
    assert runner.cost == HostCost(1.0, 0.5)
    assert seen == [(seen[0][0], True, "act")] and seen[0][0].startswith("specter-host-experts")
    assert HostExpertRunner(None, HostCost(2.0, 0.0)).cost == HostCost(2.0, 0.0) and len(seen) == 1


@pytest.fixture
def free_host(monkeypatch):
    """The host path costs nothing, so every planned expert that is not resident runs there."""
    monkeypatch.setattr(host_experts_module, "measure_host_cost", lambda store, act: HostCost(0.0, 0.0))


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen", "tiny-mixtral"])
def test_host_experts_keep_greedy_decoding_lossless(name, free_host):
    model = specter.load_model(name, device="cpu", dtype=torch.float32)
    config = specter.SpecterConfig(k=4, resident_experts_per_layer=2, host_experts=True)
    out = specter.SpecterEngine(model, config).generate(prompt(), NEW)
    assert out.token_ids == hf_greedy(name, prompt(), NEW)
    assert out.stats["host_expert_runs"] > 0 and out.stats["host_expert_pairs"] >= out.stats["host_expert_runs"]
    hidden = model.hf.config.hidden_size
    assert out.stats["host_expert_bytes"] >= out.stats["host_expert_pairs"] * hidden * 4  # at least the outputs


def test_host_experts_move_fewer_bytes_and_work_with_residual_transfer_and_batches(free_host):
    runs = {}
    for host in (False, True):
        model = specter.load_model("tiny-qwen", device="cpu", dtype=torch.bfloat16)
        config = specter.SpecterConfig(k=4, resident_experts_per_layer=2, host_experts=host, residual_transfer=True)
        engine = specter.SpecterEngine(model, config)
        runs[host] = engine.generate(prompt(), NEW)
        batch = engine.generate([prompt().tolist()[0], prompt("def f(x):").tolist()[0]], 12)
        assert batch[0].token_ids == engine.generate(prompt(), 12).token_ids
    assert runs[True].token_ids == runs[False].token_ids  # the same expert_mlp on the same device: bitwise
    assert runs[True].stats["h2d_bytes"] < runs[False].stats["h2d_bytes"]
    assert runs[True].stats["residual_decodes"] > 0 and runs[True].stats["host_expert_runs"] > 0


@pytest.mark.slow
def test_a_batch_of_32_keeps_each_requests_tokens_with_both_mechanisms(free_host):
    """Issue 21: batched decoding up to B=32 with residual transfer and host experts on; every request's
    tokens equal its own decode alone (checked on a sample of 4)."""
    model = specter.load_model("tiny-qwen", device="cpu", dtype=torch.bfloat16)
    config = specter.SpecterConfig(k=4, resident_experts_per_layer=2, host_experts=True, residual_transfer=True)
    engine = specter.SpecterEngine(model, config)
    prompts = [prompt(f"Request {i}: the answer is").tolist()[0] for i in range(32)]
    batch = engine.generate(prompts, 8)
    assert len(batch) == 32 and all(len(r.token_ids) == 8 for r in batch)
    for i in (0, 9, 20, 31):
        assert batch[i].token_ids == engine.generate(torch.tensor([prompts[i]]), 8).token_ids, i
    assert batch[0].stats["residual_decodes"] > 0 and batch[0].stats["host_expert_runs"] > 0
