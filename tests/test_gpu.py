"""CUDA checks (run on the H200 through the device tool; skipped on CPU)."""
import dataclasses

import pytest
import torch

import specter
from baselines.target_only import TargetOnly
from specter.offload.runtime import SPARE_ROWS
from specter.offload.streams import DeviceStreams
from experiments.token_check import MISMATCH, check_tokens
from tests.conftest import prompt

pytestmark = pytest.mark.gpu
HALF = [torch.bfloat16, torch.float16]  # bfloat16: the default on CUDA (the checkpoints' dtype)


def test_the_default_dtype_on_cuda_is_bfloat16():
    assert specter.load_model("tiny", device="cuda").dtype == torch.bfloat16


def assert_target_tokens(model, ids: torch.Tensor, out, reference: list[int], k: int, what,
                         slots: int | None = None) -> None:
    """The harness's rule (experiments.token_check): Specter's tokens equal target-only's, or their first divergence
    is a numeric tie of the dtype (the target flips between the two forward shapes, or its gap is within the
    dtype's bound), and the teacher-forced replay of Specter's verify windows gives exactly its tokens."""
    target = TargetOnly(model, slots)
    verdict = check_tokens(target, ids, out.token_ids, reference, k, out.stats.get("windows"),
                           out.stats.get("kv_cache_length"))
    assert verdict.verdict != MISMATCH, (what, verdict.text())


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", ["tiny", "tiny-qwen", "tiny-phi", "tiny-mixtral"])
def test_half_precision_greedy_equals_target_only_on_cuda(name, dtype):
    model = specter.load_model(name, device="cuda", dtype=dtype)
    assert model.device.type == "cuda" and model.dtype == dtype
    ids = prompt()
    reference = TargetOnly(model).generate(ids, 32).token_ids
    for k in (1, 4, 16):
        out = specter.SpecterEngine(model, specter.SpecterConfig(k=k)).generate(ids, 32)
        assert_target_tokens(model, ids, out, reference, k, (name, k))
        assert out.stats["tpot_ms"] > 0


def test_host_tap_signals_the_host_from_inside_a_cuda_graph():
    tap = DeviceStreams(torch.device("cuda")).tap((4,), torch.float32)
    assert tap is not None, "this torch has no external CUDA events"
    x, w = torch.zeros(4, device="cuda"), torch.randn(4096, 4096, device="cuda")
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        x.add_(1)
        tap.record(x)
        for _ in range(50):  # long work after the tap: the host reads before the graph ends
            w = w @ w / 64
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for step in range(1, 4):
        graph.replay()
        assert tap.result().tolist() == [float(step)] * 4  # capture itself runs nothing
    torch.cuda.synchronize()


def test_sampling_runs_on_cuda():
    model = specter.load_model("tiny", device="cuda", dtype=torch.float16)
    out = specter.SpecterEngine(model, specter.SpecterConfig(k=4, temperature=0.8)).generate(prompt(), 16)
    assert len(out.token_ids) == 16


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", ["tiny", "tiny-mixtral"])
def test_half_precision_offloaded_greedy_equals_target_only_on_cuda(name, dtype):
    model = specter.load_model(name, device="cuda", dtype=dtype)
    ids = prompt()
    reference = TargetOnly(model).generate(ids, 32).token_ids  # all experts resident
    for slots in (1, 3):
        out = specter.SpecterEngine(model, specter.SpecterConfig(k=4, resident_experts_per_layer=slots)).generate(ids, 32)
        assert_target_tokens(model, ids, out, reference, 4, (name, slots), slots)
        assert out.stats["h2d_bytes"] > 0 and out.stats["h2d_gbps"] > 0
        assert model.host_store.buffers[0].is_pinned()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", ["tiny-qwen", "tiny-mixtral"])
def test_residual_transfer_on_cuda_gives_the_raw_copies_tokens(name, dtype):
    """The Triton decode rebuilds every slot bit for bit: the same tokens and loads as raw copies, fewer bytes,
    a launch per group of a layer's loads with the group's copies issued together, also with a slot of each
    layer pooled with the spare rows (its group copies merged where neighbouring experts' blobs lie end to end)."""
    model = specter.load_model(name, device="cuda", dtype=dtype)
    options = [dict(residual_transfer=False, pooled_slots=0), dict(residual_transfer=True, pooled_slots=0),
               dict(residual_transfer=True, pooled_slots=1)]
    runs = [specter.SpecterEngine(model, specter.SpecterConfig(k=4, resident_experts_per_layer=2, coded_slots=False,
                                                               **o))
            .generate(prompt(), 32) for o in options]
    assert all(run.token_ids == runs[0].token_ids for run in runs[1:])
    assert runs[1].stats["residual_decodes"] > 0 and runs[1].stats["h2d_bytes"] < 0.75 * runs[0].stats["h2d_bytes"]
    assert 0 < runs[1].stats["residual_decodes"] < runs[1].stats["h2d_copies"] and runs[1].stats["h2d_gbps"] > 0
    assert runs[2].stats["h2d_copy_calls"] <= runs[2].stats["h2d_copies"]  # neighbours' blobs may cross as one
    assert model.offload.residuals.buffers[0].is_pinned() and model.offload.residuals.use_kernel


@pytest.mark.parametrize("name", ["tiny-qwen", "tiny-phi"])
def test_a_host_build_encoded_as_it_goes_gives_the_raw_builds_tokens_on_cuda(name):
    """keep_raw_experts=False on a host build: every layer encoded on the GPU as it is built (the decode kernel
    checked bit for bit on the experts it kept for that), no raw layer on the host, the raw build's tokens."""
    build = dict(device="cuda", dtype=torch.bfloat16, experts_on_host=True)
    config = specter.SpecterConfig(k=4, resident_experts_per_layer=2)
    expected = specter.SpecterEngine(specter.load_model(name, **build), config).generate(prompt(), 32).token_ids
    model = specter.load_model(name, **build, keep_raw_experts=False)
    assert not model.host_store.holds_raw and model.residual_store.use_kernel
    assert model.residual_store.buffers[0].is_pinned()
    out = specter.SpecterEngine(model, config, keep_raw_experts=False).generate(prompt(), 32)
    assert out.token_ids == expected and out.stats["residual_decodes"] > 0


def test_large_host_buffers_are_registered_in_place_and_copy_asynchronously():
    from specter.offload.pinned import REGISTER_MIN_BYTES, pin

    big = torch.arange(REGISTER_MIN_BYTES // 4 + 5, dtype=torch.int32)
    pinned = pin(big, torch.device("cuda"))
    assert pinned.data_ptr() == big.data_ptr() and pinned.is_pinned()  # in place, exact size
    small = pin(torch.arange(10), torch.device("cuda"))
    assert small.is_pinned()
    on_device = torch.empty_like(pinned, device="cuda")
    on_device.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(on_device.cpu(), big)


@pytest.mark.slow
def test_synthetic_full_size_dsv2_runs_under_low_and_high_memory():
    model = specter.load_model("dsv2", synthetic=True, device="cuda", experts_on_host=True)  # bfloat16
    ids = prompt()[:, :16]
    for mem in ("low", "high"):
        slots = model.spec.mem_presets[mem]
        out = specter.SpecterEngine(model, specter.SpecterConfig(k=16, resident_experts_per_layer=slots)).generate(ids, 24)
        assert len(out.token_ids) == 24 and out.stats["misses"] > 0
        cache = model.offload.cache  # coded slots (the default): more experts in the slots' 16-bit memory
        assert cache.device_bytes <= (model.num_moe_layers * slots + SPARE_ROWS) * cache.store.expert_bytes
        assert cache.slots_per_layer > slots - 2  # 2 of the 16-bit slots are pooled


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", ["tiny", "tiny-qwen"])
def test_draft_graph_replay_gives_the_eager_tokens(name, dtype):
    model = specter.load_model(name, device="cuda", dtype=dtype)
    ids = prompt()
    config = specter.SpecterConfig.paper(k=6, resident_experts_per_layer=2)  # equal residency: the same kernels
    eager = specter.SpecterEngine(model, dataclasses.replace(config, cuda_graph=False)).generate(ids, 40)
    graphed = specter.SpecterEngine(model, config)
    first, second = graphed.generate(ids, 40), graphed.generate(ids, 40)  # capture once, replay after
    assert first.stats["draft_graph"] == "on", first.stats["draft_graph"]
    assert any(t["early_batch"] for t in second.stats["prefetch_trace"])  # the counters' tap replays too
    assert first.token_ids == second.token_ids == eager.token_ids
    assert first.stats["acceptance_rate"] == eager.stats["acceptance_rate"]


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen"])
def test_a_compiled_draft_step_is_captured_and_stays_lossless(name):
    """draft_compile: the step goes through torch.compile before capture; offloaded greedy output still
    equals target-only's (float16: the verify pass is the same code; its window shapes may differ)."""
    model = specter.load_model(name, device="cuda", dtype=torch.float16)
    ids = prompt()
    reference = TargetOnly(model).generate(ids, 40).token_ids
    config = specter.SpecterConfig.paper(k=6, resident_experts_per_layer=2, draft_compile=True)
    engine = specter.SpecterEngine(model, config)
    first, second = engine.generate(ids, 40), engine.generate(ids, 40)  # compile + capture once, replay after
    assert first.stats["draft_graph"] == "on, compiled", first.stats["draft_graph"]
    assert first.token_ids == second.token_ids == reference
    assert first.stats["acceptance_rate"] > 0.5


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen"])
def test_draft_ahead_on_its_side_stream_stays_lossless(name):
    """draft_ahead: the next window drafted on a side stream (its own static cache and captured step) while
    the offloaded verify pass runs; output equals target-only's and windows take the drafts made ahead."""
    model = specter.load_model(name, device="cuda", dtype=torch.float16)
    ids = prompt()
    reference = TargetOnly(model).generate(ids, 40).token_ids
    config = specter.SpecterConfig.paper(k=4, resident_experts_per_layer=2, draft_ahead=True)
    engine = specter.SpecterEngine(model, config)
    first, second = engine.generate(ids, 40), engine.generate(ids, 40)
    assert first.stats["draft_graph"] == "on" and first.stats["draft_ahead"] == "on"
    assert first.token_ids == second.token_ids == reference
    assert second.stats["draft_ahead_windows"] > 0


@pytest.mark.parametrize("compiled", [False, True])
def test_draft_ahead_from_the_prompt_on_its_side_stream_stays_lossless(compiled):
    """Draft-ahead on CUDA: the first window drafted from the prompt on the side stream (a draft forward
    over the prompt into the static side cache, then captured steps) while the prefill runs; taken, and the
    output equals target-only's over two requests (the side cache emptied between them)."""
    model = specter.load_model("tiny-dsv2", device="cuda", dtype=torch.float16)
    ids = prompt("Natalia sold clips")
    reference = TargetOnly(model).generate(ids, 40).token_ids
    config = specter.SpecterConfig.paper(k=3, resident_experts_per_layer=2, draft_ahead=True, draft_compile=compiled)
    engine = specter.SpecterEngine(model, config)
    first, second = engine.generate(ids, 40), engine.generate(ids, 40)
    assert first.token_ids == second.token_ids == reference
    assert second.stats["draft_ahead_prompt_windows"] == 1


@pytest.mark.parametrize("prompt_length", [20, 250])  # tiny-phi switches at 256: the longer prompt crosses it
def test_the_default_on_a_longrope_model_captures_compiles_drafts_ahead_and_equals_the_target(prompt_length):
    """Phi's longrope picks its regime on the device, so the default captures, compiles and drafts ahead
    there too, and its tokens are the resident target's, across the switch as well."""
    model = specter.load_model("tiny-phi", device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor([[256, *(b"Natalia sold clips. " * 13)[:prompt_length - 1]]], device="cuda")
    reference = TargetOnly(model).generate(ids, 40).token_ids  # before the experts move to the host
    engine = specter.SpecterEngine(model, specter.SpecterConfig(resident_experts_per_layer=4))
    out = engine.generate(ids, 40)
    assert all(state == "on" for state in out.stats["mechanisms"].values()), out.stats["mechanisms"]
    assert out.stats["draft_graph"] == "on, compiled" and out.stats["draft_ahead_launches"] > 0
    assert_target_tokens(model, ids, out, reference, engine.config.k, ("tiny-phi", prompt_length), slots=4)


def test_a_refused_capture_is_not_listed_as_run_and_leaves_the_cuda_generator_usable(monkeypatch):
    """A capture that fails falls back to the eager draft, says why, and records.csv does not list the CUDA
    graph or its compilation as run; the CUDA generator stays usable."""
    import specter.draft.graph
    from experiments.records import mechanisms_ran

    def refuse(*args, **kwargs):
        torch.cuda.synchronize()
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(specter.draft.graph, "DraftStepGraph", refuse)
    model = specter.load_model("tiny-phi", device="cuda")
    out = specter.SpecterEngine(model, specter.SpecterConfig(k=4)).generate(prompt().cuda(), 8)
    assert out.stats["draft_graph"].startswith("failed: RuntimeError")
    assert out.stats["mechanisms"]["cuda_graph"].startswith("off: RuntimeError")
    assert out.stats["mechanisms"]["draft_compile"].startswith("off: no CUDA graph to compile into")
    assert "cuda_graph" not in mechanisms_ran(out.stats["mechanisms"]).split()
    assert torch.randn(4, device="cuda").isfinite().all()  # the generator still works


def test_the_link_measurement_agrees_with_a_plain_large_copy():
    """measure_link (>= 1 GiB a trial in 64 MiB copies, warm-up dropped, the max of 10 trials) against one plain
    1 GiB pinned copy timed alone (best of 5): within 10%."""
    from specter.offload.pinned import measure_link

    src = torch.empty(2**30, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    rates = []
    for _ in range(6):  # the first warms up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        rates.append(src.numel() / (start.elapsed_time(end) * 1e6))
    plain = max(rates[1:])
    link = measure_link("cuda", [src])
    assert len(link.trials_gbps) == 10 and link.bytes_per_trial >= 2**30
    assert abs(link.max_gbps - plain) <= 0.10 * plain, (link.as_dict(), plain)
    print(f"link {link.max_gbps} GB/s (median {link.median_gbps}, min {link.min_gbps}); plain 1 GiB copy {plain:.2f}")


@pytest.mark.parametrize("system", ["specter", "mo_sm"])
def test_the_time_per_token_parts_sum_to_the_tpot_on_cuda(system):
    """The tpot_* parts (CUDA events on the compute stream) partition the decode span: they sum to TPOT."""
    from baselines.mixtral_offloading import MixtralOffloading
    from experiments.records import TPOT_PARTS
    model = specter.load_model("tiny-dsv2", device="cuda")
    engine = specter.SpecterEngine(model, specter.SpecterConfig(resident_experts_per_layer=2)) \
        if system == "specter" else MixtralOffloading(model, 2)
    engine.generate(prompt().cuda(), 8)  # warm-up
    stats = engine.generate(prompt().cuda(), 32).stats
    assert all(stats[c] >= 0 for c in TPOT_PARTS), stats
    assert sum(stats[c] for c in TPOT_PARTS) == pytest.approx(stats["tpot_ms"], rel=1e-3)
    assert stats["tpot_copy_wait_ms"] + stats["tpot_rebuild_ms"] > 0  # 2 of 64 experts per layer: it waits
