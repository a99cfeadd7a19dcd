"""Batched decoding: every request of a batch decodes exactly as it would alone (tiny models, float32)."""
import functools

import pytest
import torch

import specter
import specter.batch.engine as batch_engine
from specter.batch.state import BatchState
from specter.errors import SpecterError
from specter.speculative.state import new_static_cache
from tests.conftest import tiny_model

fresh = functools.lru_cache(maxsize=None)(lambda name: specter.load_model(name, device="cpu", dtype=torch.float32))
# offloading moves a model's experts to the host store: those tests use their own copy (`fresh`)

PROMPTS = [[256, *b"Natalia sold clips"], [256, *b"def f(x):"], [256, *b"The tower is 324 metres tall, about"],
           [256, 7]]


def solo(engine, prompts, tokens, eos=None):
    return [engine.generate(torch.tensor([p]), tokens, eos_token_id=eos).token_ids for p in prompts]


@pytest.mark.parametrize("slots", [None, 1])
def test_every_request_equals_its_solo_decode(tiny_name, slots):
    model = tiny_model(tiny_name) if slots is None else fresh(tiny_name)
    engine = specter.SpecterEngine(model, specter.SpecterConfig(k=4, resident_experts_per_layer=slots))
    batch = engine.generate(PROMPTS, 16)
    assert [r.token_ids for r in batch] == solo(engine, PROMPTS, 16)
    histograms = {str(r.stats["accepted_length_histogram"]) for r in batch}
    assert len(histograms) > 1  # the requests accepted different lengths: their KV holes differ
    assert all(r.stats["batch_size"] == len(PROMPTS) and r.stats["throughput_tok_s"] > 0 for r in batch)


def test_batch_of_one_equals_the_unbatched_engine():
    engine = specter.SpecterEngine(fresh("tiny"), specter.SpecterConfig(k=3, resident_experts_per_layer=2))
    [result] = engine.generate([PROMPTS[0]], 12)
    single = engine.generate(torch.tensor([PROMPTS[0]]), 12)
    assert result.token_ids == single.token_ids
    assert result.stats["acceptance_rate"] == single.stats["acceptance_rate"]


def test_a_request_ending_early_does_not_disturb_the_others():
    engine = specter.SpecterEngine(tiny_model("tiny-mixtral"), specter.SpecterConfig(k=4))
    alone = solo(engine, PROMPTS, 16)
    eos = alone[1][3]  # request 1 ends at (or before) its 4th token
    batch = engine.generate(PROMPTS, 16, eos_token_id=eos)
    assert batch[1].token_ids == alone[1][: alone[1].index(eos) + 1]
    for r in (0, 2, 3):
        expected = alone[r][: alone[r].index(eos) + 1] if eos in alone[r] else alone[r]
        assert batch[r].token_ids == expected
    assert batch[1].stats["generated_tokens"] < batch[0].stats["generated_tokens"]  # it stopped committing


def test_on_commit_hears_each_request_and_a_false_ends_only_that_request():
    engine = specter.SpecterEngine(fresh("tiny-qwen"), specter.SpecterConfig(k=4, resident_experts_per_layer=2))
    alone = solo(engine, PROMPTS, 16)
    heard: dict[int, list[int]] = {r: [] for r in range(len(PROMPTS))}

    def on_commit(request, tokens):
        heard[request] += tokens
        return not (request == 2 and len(heard[request]) >= 3)  # request 2 ends after its first 3 tokens

    batch = engine.generate(PROMPTS, 16, on_commit=on_commit)
    assert [r.token_ids for r in batch] == [alone[0], alone[1], heard[2], alone[3]]
    assert [heard[r][:16] for r in (0, 1, 3)] == [alone[0], alone[1], alone[3]]  # commits as they happened
    assert 3 <= len(heard[2]) < 16 and heard[2] == alone[2][:len(heard[2])]
    assert batch[2].stats["generated_tokens"] == len(heard[2])


def test_batched_offload_shares_the_cache_and_counts_the_working_set():
    engine = specter.SpecterEngine(fresh("tiny-qwen"), specter.SpecterConfig(k=4, resident_experts_per_layer=2))
    one = engine.generate([PROMPTS[0]], 12)[0].stats
    results = engine.generate(PROMPTS, 12)
    four = results[0].stats
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert mean(four["window_working_sets"]) > mean(one["window_working_sets"])  # more requests, more experts
    assert four["decode_h2d_bytes_per_token"] < one["decode_h2d_bytes_per_token"] * 4
    decode_tokens = sum(r.stats["generated_tokens"] - 1 for r in results)  # after each request's first token
    assert four["decode_h2d_bytes_per_token"] == four["decode_h2d_bytes"] / decode_tokens


@pytest.mark.parametrize("bad, message", [([[]], "T >= 1"), ([[1, 2], []], "T >= 1")])
def test_bad_batches_are_clear_errors(bad, message):
    engine = specter.SpecterEngine(tiny_model("tiny"), specter.SpecterConfig(k=2))
    with pytest.raises(SpecterError, match=message):
        engine.generate(bad, 4)


def test_batched_sampling_is_refused():
    engine = specter.SpecterEngine(tiny_model("tiny"), specter.SpecterConfig(k=2, temperature=0.8))
    with pytest.raises(SpecterError, match="greedy only"):
        engine.generate(PROMPTS[:2], 4)


def test_static_batch_cache_with_compaction_equals_solo(tiny_name, monkeypatch):
    """The CUDA-graph layout on CPU (eager): a fixed-width static cache, 4D masks, and compaction when
    the holes fill it (the cache is sized so that it must compact several times)."""
    model, k, tokens = tiny_model(tiny_name), 4, 32
    length = max(map(len, PROMPTS)) + tokens + 2 * k + 1  # the longest request overshoots by k, + a pass
    compactions = []
    monkeypatch.setattr(batch_engine, "static_batch_cache", lambda *_: new_static_cache(model, length))
    monkeypatch.setattr(BatchState, "make_room", _counting(BatchState.make_room, compactions))
    engine = specter.SpecterEngine(model, specter.SpecterConfig(k=k))
    batch = engine.generate(PROMPTS, tokens)
    assert [r.token_ids for r in batch] == solo(engine, PROMPTS, tokens)
    assert sum(compactions) >= 2
    assert batch[0].stats["draft_graph"].startswith("off")  # no CUDA here: the static layout runs eagerly


def _counting(make_room, compactions):
    def wrapped(state, columns):
        width = state.mask.shape[1]
        make_room(state, columns)
        compactions.append(state.mask.shape[1] < width)
    return wrapped


def test_too_short_static_batch_cache_is_a_clear_error():
    model = tiny_model("tiny")
    state = BatchState(model, [torch.tensor([p]) for p in PROMPTS[:2]], new_static_cache(model, 24))
    state.prefill()
    with pytest.raises(ValueError, match="too short"):
        state.make_room(24)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny", "tiny-qwen"])
def test_batch_equals_solo_on_cuda_with_offload(name):
    model = specter.load_model(name, device="cuda", dtype=torch.float16)
    engine = specter.SpecterEngine(model, specter.SpecterConfig(k=4, resident_experts_per_layer=2))
    batch = engine.generate(PROMPTS, 24)
    assert batch[0].stats["draft_graph"].startswith("on")  # the batched draft step replays a captured graph
    assert [r.token_ids for r in batch] == solo(engine, PROMPTS, 24)
    assert batch[0].stats["h2d_bytes"] > 0


@pytest.mark.parametrize("system", ["target_only", "mo_sm"])
def test_autoregressive_baselines_batch_like_they_decode_alone(system):
    from baselines.mixtral_offloading import MixtralOffloading
    from baselines.target_only import TargetOnly
    model = fresh("tiny-qwen")
    baseline = TargetOnly(model, 2) if system == "target_only" else MixtralOffloading(model, 3, memory="same memory")
    batch = baseline.generate(PROMPTS, 10)
    assert [r.token_ids for r in batch] == [baseline.generate(torch.tensor([p]), 10).token_ids for p in PROMPTS]
    assert all(r.stats["batch_size"] == len(PROMPTS) and r.stats["h2d_bytes"] > 0 for r in batch)


def test_transformers_native_batching_matches_its_solo_decodes(tiny_name):
    from baselines.hf_transformers import Transformers
    baseline = Transformers(tiny_model(tiny_name))
    batch = baseline.generate(PROMPTS, 10)
    assert [r.token_ids for r in batch] == [baseline.generate(torch.tensor([p]), 10).token_ids for p in PROMPTS]
    assert batch[0].stats["generated_tokens"] == 10 and batch[0].stats["batch_size"] == len(PROMPTS)


@pytest.mark.parametrize("name", ["tiny", "tiny-mixtral"])
def test_specmoeoff_microbatches_match_its_solo_decodes(name):
    from baselines.specmoeoff.engine import SpecMoEOff, SpecMoEOffConfig
    engine = SpecMoEOff(fresh(name), SpecMoEOffConfig(slots=2, fixed_k=3))
    batch = engine.generate(PROMPTS[:3], 12)
    assert [r.token_ids for r in batch] == [engine.generate(torch.tensor([p]), 12).token_ids for p in PROMPTS[:3]]
    stats = batch[0].stats
    assert stats["microbatches"] == 2 and stats["batch_size"] == 3 and stats["h2d_bytes"] > 0
    assert 0 < stats["acceptance_rate"] <= 1


def test_a_system_without_batch_mode_is_a_reason_row(tmp_path):
    from types import SimpleNamespace

    from experiments.batch import usable_systems
    from experiments.records import RecordWriter
    writer = RecordWriter(tmp_path)
    single = SimpleNamespace(name="single", available=lambda: (True, ""))
    batched = SimpleNamespace(name="batched", available=lambda: (True, ""), batch_mode=True)
    assert usable_systems([single, batched], writer, {"k": 4}) == [batched]
    assert writer.rows[0]["system"] == "single" and writer.rows[0]["status"].startswith("unavailable: ")


def test_batch_cases_honour_token_caps_and_check_the_reference_prefix(tmp_path):
    from types import SimpleNamespace

    from experiments.batch import run_batch_case
    from experiments.records import RecordWriter
    from specter.metrics import GenerationResult

    def system(name, tokens):
        stats = {"mean_tpot_ms": 1.0, "throughput_tok_s": 2.0, "generated_tokens": 0, "acceptance_rate": 1.0}
        return SimpleNamespace(name=name, generate=lambda requests, n: [GenerationResult(tokens[:n], dict(stats))
                                                                        for _ in requests])
    writer = RecordWriter(tmp_path)
    run_batch_case([system("slow", [1, 2, 9]), system("target_only", [1, 2, 3, 4])], {"dataset": "d", "batch_size": 2},
                   [torch.tensor([[1]])] * 2, 4, writer, {"slow": 2})
    assert [r["system"] for r in writer.rows] == ["target_only", "slow"]  # the reference runs first
    rows = {r["system"]: r for r in writer.rows}
    assert rows["slow"]["tokens_match_target"] == "yes"  # its 2 tokens are target-only's first 2


def test_a_case_cut_midway_keeps_the_rows_already_measured(tmp_path):
    from types import SimpleNamespace

    from experiments.batch import run_batch_case
    from experiments.records import RecordWriter
    from specter.metrics import GenerationResult

    def cut(requests, n):
        raise TimeoutError("the call limit")

    stats = {"mean_tpot_ms": 1.0, "throughput_tok_s": 2.0, "generated_tokens": 4}
    done = SimpleNamespace(name="mo_sm", generate=lambda requests, n: [GenerationResult([1] * n, dict(stats))
                                                                       for _ in requests])
    writer = RecordWriter(tmp_path)
    with pytest.raises(TimeoutError):
        run_batch_case([done, SimpleNamespace(name="specmoeoff_sm", generate=cut)], {"dataset": "d", "batch_size": 2},
                       [torch.tensor([[1]])] * 2, 4, writer)
    assert [r["system"] for r in RecordWriter(tmp_path, resume=True).rows] == ["mo_sm"]
