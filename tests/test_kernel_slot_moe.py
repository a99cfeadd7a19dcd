"""Slot-buffer FP MoE Triton kernel against the torch reference: CPU interpreter cases, real shapes on CUDA."""
import subprocess  # noqa: E402
import sys  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.triton_mode import INTERPRETED, ROOT, interpreted, run_interpreter_cases  # noqa: F401 (before triton)

pytest.importorskip("triton")

from specter.kernels import slot_moe as K  # noqa: E402
from specter.kernels.int4_moe import KernelConfig, MoEWorkspace  # noqa: E402
from specter.kernels.reference import combine_rows, expert_wise_moe  # noqa: E402

SILU = torch.nn.functional.silu
SENTINEL = 123.0


def test_interpreter_cases_in_subprocess(request):
    """In a compiled-mode process (CUDA machine, or triton already imported), the CPU cases run in a fresh one."""
    run_interpreter_cases(__file__, request)


def make_store(experts, hidden, inter, gen, dtype=torch.float32, device="cpu"):
    """All experts' flat weights [E, 3*I*H]: gate_up [2I, H] then down [H, I], scaled for O(1) outputs."""
    gate_up = torch.randn(experts, 2 * inter * hidden, generator=gen) / hidden ** 0.5
    down = torch.randn(experts, hidden * inter, generator=gen) / inter ** 0.5
    return torch.cat([gate_up, down], dim=1).to(device, dtype)


def make_routing(tokens, experts, k, gen):
    """top_k_index [T, k], distinct experts per token, geometric popularity (some experts get nothing)."""
    probs = 0.6 ** torch.arange(experts, dtype=torch.float)
    return torch.multinomial(probs.expand(tokens, experts), k, replacement=False, generator=gen)


def fill_slots(store, chosen, slots, gen):
    """slot_buffer [S, 3IH] with `chosen` experts in random distinct slots (others garbage); slot_of_expert [E]."""
    buf = torch.randn(slots, store.shape[1], generator=gen).to(store) * 100  # unused slots: loud garbage
    slot_of = torch.full((store.shape[0],), -1, dtype=torch.long)
    for e, s in zip(chosen, torch.randperm(slots, generator=gen)[:len(chosen)].tolist()):
        slot_of[e] = s
        buf[s] = store[e]
    return buf, slot_of.to(store.device)


def make_case(tokens, experts, slots, k, hidden, inter, seed=0):
    gen = torch.Generator().manual_seed(seed)
    store = make_store(experts, hidden, inter, gen)
    x = torch.randn(tokens, hidden, generator=gen)  # [T, H]
    idx = make_routing(tokens, experts, k, gen)  # [T, k]
    chosen = torch.randperm(experts, generator=gen)[:slots].tolist()  # may include unrouted experts
    buf, slot_of = fill_slots(store, chosen, slots, gen)
    return store, x, idx, buf, slot_of


def sentinel_rows(idx, hidden, device="cpu"):
    return torch.full((idx.numel(), hidden), SENTINEL, dtype=torch.float32, device=device)


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


# (T, E, S, k, H, I): T in {1, 5, 17, 40}, E in {4, 8}, S in {1, 3, 8}, k in {1, 2, 4}, H and I in {128, 256}
CPU_CASES = [
    (1, 4, 1, 1, 128, 128),
    (1, 8, 8, 4, 256, 128),
    (5, 4, 3, 2, 128, 256),
    (5, 8, 3, 4, 128, 128),
    (17, 8, 8, 2, 128, 128),  # every expert has a slot
    (17, 4, 1, 4, 256, 256),
    (40, 8, 3, 1, 128, 128),  # the hot expert spans several M-blocks (if it has a slot)
    (40, 4, 3, 2, 128, 128),
]


@interpreted
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: "T{}-E{}-S{}-k{}-H{}-I{}".format(*c))
def test_matches_reference_and_skips_fp32(case):
    tokens, experts, slots, k, hidden, inter = case
    _, x, idx, buf, slot_of = make_case(*case, seed=sum(case))
    out, ref = sentinel_rows(idx, hidden), sentinel_rows(idx, hidden)
    K.slot_moe_rows(x, idx, buf, slot_of, inter, out, SILU)
    K.slot_moe_rows_reference(x, idx, buf, slot_of, inter, ref, SILU)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    computed = slot_of[idx.reshape(-1)] >= 0  # [T*k]
    assert torch.all(out[~computed] == SENTINEL)  # skipped experts' rows untouched
    assert not torch.any(out[computed] == SENTINEL)


@interpreted
@pytest.mark.parametrize("case", [(17, 8, 2, 128, 128), (40, 4, 2, 128, 256)])
def test_disjoint_calls_equal_full_call_and_expert_wise(case):
    tokens, experts, k, hidden, inter = case
    gen = torch.Generator().manual_seed(tokens)
    store = make_store(experts, hidden, inter, gen)
    x, idx = torch.randn(tokens, hidden, generator=gen), make_routing(tokens, experts, k, gen)
    w = torch.randn(tokens, k, generator=gen).softmax(-1)  # [T, k]
    full = sentinel_rows(idx, hidden)
    K.slot_moe_rows(x, idx, store, torch.arange(experts), inter, full)  # the store as an all-experts buffer
    perm = torch.randperm(experts, generator=gen).tolist()
    parts, ws = sentinel_rows(idx, hidden), MoEWorkspace()
    for subset in (perm[:experts // 2], perm[experts // 2:]):
        buf, slot_of = fill_slots(store, subset, len(subset) + 1, gen)  # one spare (garbage) slot
        K.slot_moe_rows(x, idx, buf, slot_of, inter, parts, workspace=ws)
    torch.testing.assert_close(parts, full, rtol=1e-5, atol=1e-6)
    assert not torch.any(full == SENTINEL)
    ref = expert_wise_moe(x, idx, w, lambda e: K.slot_views(store, e, inter), experts, SILU)
    torch.testing.assert_close(combine_rows(full, w, x.dtype), ref, rtol=1e-4, atol=1e-5)


@interpreted
@pytest.mark.parametrize("case", [(9, 8, 3, 128, 128), (40, 4, 2, 128, 256)])
def test_waves_sharing_one_alignment_equal_separate_calls(case):
    """A layer's waves: one align_routing, then calls with disjoint slot maps (the same slot reused)."""
    tokens, experts, k, hidden, inter = case
    gen = torch.Generator().manual_seed(tokens + experts)
    store = make_store(experts, hidden, inter, gen)
    x, idx = torch.randn(tokens, hidden, generator=gen), make_routing(tokens, experts, k, gen)
    separate, shared, ws = sentinel_rows(idx, hidden), sentinel_rows(idx, hidden), MoEWorkspace()
    align = K.align_routing(idx, experts, workspace=ws)
    perm = torch.randperm(experts, generator=gen).tolist()
    for subset in (perm[:experts // 2], perm[experts // 2: -1]):  # the last expert is never computed
        buf, slot_of = fill_slots(store, subset, len(subset), gen)
        K.slot_moe_rows(x, idx, buf, slot_of, inter, separate)
        K.slot_moe_rows(x, idx, buf, slot_of, inter, shared, workspace=ws, alignment=align)
    torch.testing.assert_close(shared, separate, rtol=0, atol=0)
    last = idx.reshape(-1) == perm[-1]  # [T*k]
    assert torch.all(shared[last] == SENTINEL) and not torch.any(shared[~last] == SENTINEL)
    with pytest.raises(ValueError, match="block_m"):
        K.slot_moe_rows(x, idx, buf, slot_of, inter, shared, alignment=align, config=KernelConfig(block_m=32))


@interpreted
@pytest.mark.parametrize("case", [(9, 8, 3, 128, 128), (40, 4, 2, 128, 256)])
def test_prepared_waves_equal_separate_calls(case):
    """slot_moe_waves: one layer's launches prepared once, then a call per slot map over one pool."""
    tokens, experts, k, hidden, inter = case
    gen = torch.Generator().manual_seed(tokens * experts)
    store = make_store(experts, hidden, inter, gen)  # the pool: expert e in row e
    x, idx = torch.randn(tokens, hidden, generator=gen), make_routing(tokens, experts, k, gen)
    separate, prepared, ws = sentinel_rows(idx, hidden), sentinel_rows(idx, hidden), MoEWorkspace()
    waves = K.slot_moe_waves(x, idx, store, inter, prepared, K.align_routing(idx, experts, workspace=ws),
                             workspace=ws)
    perm = torch.randperm(experts, generator=gen).tolist()
    for subset in (perm[:experts // 2], perm[experts // 2: -1]):  # the last expert is never computed
        row_of = torch.full((experts,), -1, dtype=torch.long)
        row_of[subset] = torch.tensor(subset)
        K.slot_moe_rows(x, idx, store, row_of, inter, separate)
        waves(row_of)
    torch.testing.assert_close(prepared, separate, rtol=0, atol=0)
    assert torch.any(prepared == SENTINEL) and not torch.all(prepared == SENTINEL)
    with pytest.raises(ValueError, match="slot_of_expert"):
        waves(row_of[None])
    with pytest.raises(ValueError, match="block_m"):
        K.slot_moe_waves(x, idx, store, inter, prepared, K.align_routing(idx, experts),
                         config=KernelConfig(block_m=32))


@interpreted
def test_residency_waves_with_the_slot_kernel_equal_the_reference():
    """The residency manager's Triton path (one alignment per layer, a slot map per wave) on random plans."""
    import random

    from specter.kernels.moe_align import MoEWorkspace
    from specter.offload.eviction import LRUPolicy, RoutingCounts
    from specter.offload.expert_cache import ExpertCache
    from specter.offload.host_store import HostExpertStore
    from specter.offload.streams import DeviceStreams
    from specter.verify.residency import ResidencyManager, VerifyOptions
    from tests.test_residency import layer_module, plan_of, random_plan

    layers, experts, hidden, inter, top_k = 2, 8, 128, 128, 2
    gen, rng = torch.Generator().manual_seed(5), random.Random(5)
    store = HostExpertStore(layers, experts, hidden, inter, torch.float32, torch.device("cpu"))
    for layer in range(layers):
        store.put_layer(layer, torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5,
                        torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5)
    cache = ExpertCache(store, 3, torch.device("cpu"), DeviceStreams(torch.device("cpu")), LRUPolicy(), 0)
    manager = ResidencyManager(cache, RoutingCounts(), VerifyOptions(wave=2), MoEWorkspace())
    manager.slot_kernel = True
    for _ in range(3):
        x = torch.randn(4, hidden, generator=gen)  # [T, H]
        routing = [make_routing(4, experts, top_k, gen) for _ in range(layers)]
        weights = torch.rand(4, top_k, generator=gen).softmax(-1)
        plan = plan_of({layer: random_plan(rng, set(routing[layer].reshape(-1).tolist())) for layer in range(layers)})
        verify = manager.window(plan)
        for layer in range(layers):
            module = SimpleNamespace(**{**vars(layer_module(layer)), "num_experts": experts,
                                        "intermediate_dim": inter})
            out = verify(module, x, routing[layer], weights)
            weights_of = lambda e, layer=layer: store.split(store.expert(layer, e))  # noqa: E731
            ref = expert_wise_moe(x, routing[layer], weights, weights_of, experts, SILU)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
        manager.take_demand()


@interpreted
def test_fp16_non_default_tiles_and_workspace_reuse():
    store, x, idx, buf, slot_of = make_case(17, 8, 3, 2, 128, 256, seed=3)
    buf, x = buf.half(), x.half()
    ref = sentinel_rows(idx, 128)
    K.slot_moe_rows_reference(x, idx, buf, slot_of, 256, ref)
    ws, cfg = MoEWorkspace(), KernelConfig(block_m=32, block_n=128, block_k=128)
    first = sentinel_rows(idx, 128)
    K.slot_moe_rows(x, idx, buf, slot_of, 256, first, workspace=ws, config=cfg)
    ptrs = {key: b.data_ptr() for key, b in ws._buffers.items()}
    second = sentinel_rows(idx[:5], 128)
    K.slot_moe_rows(x[:5], idx[:5], buf, slot_of, 256, second, workspace=ws, config=cfg)
    assert {key: b.data_ptr() for key, b in ws._buffers.items()} == ptrs  # smaller call: no reallocation
    computed = slot_of[idx.reshape(-1)] >= 0
    assert rel_err(first[computed], ref[computed]) < 5e-3 and torch.equal(first[~computed], ref[~computed])
    torch.testing.assert_close(second, first[:10], rtol=1e-3, atol=1e-3)


@interpreted
def test_all_skipped_and_zero_tokens():
    _, x, idx, buf, slot_of = make_case(5, 4, 2, 2, 128, 128)
    rows = sentinel_rows(idx, 128)
    K.slot_moe_rows(x, idx, buf, torch.full_like(slot_of, -1), 128, rows)
    assert torch.all(rows == SENTINEL)
    K.slot_moe_rows(x[:0], idx[:0], buf, slot_of, 128, rows[:0])


def test_argument_checks():
    _, x, idx, buf, slot_of = make_case(3, 4, 2, 2, 128, 128)
    rows = sentinel_rows(idx, 128)
    with pytest.raises(ValueError, match="SiLU"):
        K.slot_moe_rows(x, idx, buf, slot_of, 128, rows, torch.nn.functional.gelu)
    with pytest.raises(ValueError, match="rows must be fp32"):
        K.slot_moe_rows(x, idx, buf, slot_of, 128, rows.half())
    with pytest.raises(ValueError, match="slot_buffer"):
        K.slot_moe_rows(x, idx, buf, slot_of, 256, rows)
    assert K.TRITON_AVAILABLE


def test_imports_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, specter.kernels.slot_moe as m\n"
            "assert not m.TRITON_AVAILABLE\n"
            "try:\n    m.slot_moe_rows(*[torch.zeros(1, 1)] * 4, 1, torch.zeros(1, 1))\n"
            "except RuntimeError:\n    pass\nelse:\n    raise SystemExit('no RuntimeError')\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


# Real target shapes (hidden, intermediate, experts, slots, top_k); fp16 on CUDA with the compiled kernels.
GPU_SHAPES = {"dsv2-lite": (2048, 1408, 64, 16, 6), "phi3.5-moe": (4096, 6400, 16, 2, 2)}


@pytest.mark.gpu
class TestCuda:
    @pytest.fixture(scope="class")
    def kernels(self):
        if INTERPRETED:
            pytest.skip("TRITON_INTERPRET=1 in this process: the real shapes need the compiled kernels")
        return K

    @pytest.fixture(scope="class", params=list(GPU_SHAPES))
    def layer(self, request):
        hidden, inter, experts, slots, k = GPU_SHAPES[request.param]
        torch.manual_seed(0)
        buf = torch.randn(slots, 3 * inter * hidden, device="cuda", dtype=torch.float16) * 0.02
        slot_of = torch.full((experts,), -1, dtype=torch.long)
        slot_of[torch.randperm(experts)[:slots]] = torch.randperm(slots)
        return buf, slot_of.cuda(), hidden, inter, experts, k

    def case(self, layer, tokens):
        buf, slot_of, hidden, inter, experts, k = layer
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.float16)
        idx = torch.rand(tokens, experts, device="cuda").topk(k).indices  # [T, k]
        return x, idx, sentinel_rows(idx, hidden, "cuda")

    @pytest.mark.parametrize("tokens", [1, 17, 64])
    def test_matches_reference(self, kernels, layer, tokens):
        buf, slot_of, hidden, inter, experts, k = layer
        x, idx, out = self.case(layer, tokens)
        ref = out.clone()
        kernels.slot_moe_rows(x, idx, buf, slot_of, inter, out, workspace=MoEWorkspace())
        kernels.slot_moe_rows_reference(x, idx, buf, slot_of, inter, ref)
        computed = slot_of[idx.reshape(-1)] >= 0
        assert torch.all(out[~computed] == SENTINEL) and torch.isfinite(out).all()
        if computed.any():
            assert rel_err(out[computed], ref[computed]) < 1e-2

    @pytest.mark.parametrize("tokens", [1, 17])
    def test_matches_reference_in_bfloat16(self, kernels, layer, tokens):
        """bfloat16 (the default dtype on CUDA): the slot pool and activations in bf16."""
        buf, slot_of, hidden, inter, experts, k = layer
        buf = buf.bfloat16()
        x, idx, out = self.case(layer, tokens)  # rows stay float32, as in verification
        x = x.bfloat16()
        ref = out.clone()
        kernels.slot_moe_rows(x, idx, buf, slot_of, inter, out, workspace=MoEWorkspace())
        kernels.slot_moe_rows_reference(x, idx, buf, slot_of, inter, ref)
        computed = slot_of[idx.reshape(-1)] >= 0
        assert torch.isfinite(out).all()
        if computed.any():
            assert rel_err(out[computed], ref[computed]) < 3e-2

    def test_compiled_launches_give_the_jits_rows(self, kernels, layer):
        """A workspace launches a signature's later calls through the compiled kernel's own launcher
        (`CompiledLaunch`): across token counts and repeats, the rows of a fresh JIT launch, bit for bit."""
        buf, slot_of, hidden, inter, experts, k = layer
        ws = MoEWorkspace()
        for tokens in (1, 17, 1, 17, 64, 64):
            x, idx, out = self.case(layer, tokens)
            jit = out.clone()
            kernels.slot_moe_rows(x, idx, buf, slot_of, inter, out, workspace=ws)
            kernels.slot_moe_rows(x, idx, buf, slot_of, inter, jit)  # no workspace: through the JIT
            assert torch.equal(out, jit), tokens

    def test_prepared_waves_give_the_jits_rows_without_synchronizing(self, kernels, layer):
        """slot_moe_waves' later calls go straight to the compiled launchers: each slot map's rows equal a
        fresh JIT launch's, bit for bit, and no call synchronizes."""
        buf, slot_of, hidden, inter, experts, k = layer
        x, idx, out = self.case(layer, 17)
        ws, jit = MoEWorkspace(), out.clone()
        waves = kernels.slot_moe_waves(x, idx, buf, inter, out, kernels.align_routing(idx, experts, ws), workspace=ws)
        maps = [torch.where(slot_of % 3 == part, slot_of, -1) for part in range(3)]  # disjoint slot maps
        waves(maps[0])  # compiles outside the check
        kernels.slot_moe_rows(x, idx, buf, maps[0], inter, jit)
        torch.cuda.set_sync_debug_mode("error")
        try:
            for slot_map in maps[1:]:
                waves(slot_map)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for slot_map in maps[1:]:
            kernels.slot_moe_rows(x, idx, buf, slot_map, inter, jit)  # no workspace: through the JIT
        assert torch.equal(out, jit)

    def test_call_does_not_synchronize(self, kernels, layer):
        buf, slot_of, hidden, inter, experts, k = layer
        x, idx, out = self.case(layer, 16)
        ws = MoEWorkspace()
        kernels.slot_moe_rows(x, idx, buf, slot_of, inter, out, workspace=ws)  # compile outside the check
        torch.cuda.set_sync_debug_mode("error")
        try:
            kernels.slot_moe_rows(x, idx, buf, slot_of, inter, out, workspace=ws)
        finally:
            torch.cuda.set_sync_debug_mode("default")
