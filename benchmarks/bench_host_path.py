"""The verify pass's host work per expert load and per wave, on CPU with CUDA faked (no GPU needed).

The offload runtime's own code (`ResidencyManager`, `ExpertCache`, `DeviceStreams`, grouped residual loads)
verifies windows of a DeepSeek-V2-Lite-shaped layer stack (26 MoE layers, 64 experts, top-6, 33 tokens: K=32)
through 4 slots per layer (mem=low), as Specter's defaults run them (residual loads in decode groups of 8 with
their copies issued together, 2 slots of each layer pooled, waves of every slot), with every CUDA call
faked: events and streams only count what is asked of them (a stream waiting for an event that was never
recorded fails: an ordering bug), the residual decode and the wave kernels do nothing, the tensors are tiny.
What it measures is the part of the host's time per load and per wave that does not depend on the GPU, the
Python of the runtime, and the CUDA calls the host makes per load and per wave (each costs the H200 hosts a
few microseconds more). The plan is the window's
own routing (the draft predicted it all), so almost every routed expert is streamed as on calibrated dsv2.

    python benchmarks/bench_host_path.py [--windows 20] [--variants pooled=0 wave=0 group_copies=false]

A variant sets `HostPathOptions` fields (wave, group, group_copies, pooled, slots, spare_rows, staging_rows)
as key=value pairs joined by commas; each runs in the same process after the defaults, on the same windows.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import pstats
import sys
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import specter.offload.streams as streams_module  # noqa: E402
import specter.verify.residency as residency_module  # noqa: E402
from specter.hooks import attributes_set  # noqa: E402
from specter.kernels.moe_align import MoEWorkspace  # noqa: E402
from specter.offload.coded_slots import CodedSlots, coded_rows  # noqa: E402
from specter.offload.eviction import LRUPolicy, RoutingCounts  # noqa: E402
from specter.offload.expert_cache import ExpertCache  # noqa: E402
from specter.offload.host_reads import HostRead  # noqa: E402
from specter.offload.host_store import HostExpertStore  # noqa: E402
from specter.offload.streams import DeviceStreams  # noqa: E402
from specter.prefetch.lookahead import Ranking  # noqa: E402
from specter.prefetch.planner import WindowPlan  # noqa: E402
from specter.verify.residency import ResidencyManager, VerifyOptions  # noqa: E402


class FakeCuda:
    """Stand-ins for torch.cuda's events and streams that count every call by kind in `calls` (holding none of
    the objects, so the host's garbage collector sees what it would with CUDA); a stream's wait for an event
    never recorded, or a query of one, raises AssertionError (real CUDA would let it pass at once, or call it
    done: a race)."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.compute = self.stream("compute")
        calls = self.calls

        class Event:
            def __init__(self, enable_timing: bool = False, **_) -> None:
                self.stream = None
                calls["event"] += 1

            def record(self, stream=None) -> None:
                self.stream = stream
                calls["record"] += 1

            def query(self) -> bool:
                assert self.stream is not None, "a query of an event never recorded (CUDA says it is done)"
                calls["query"] += 1
                return False  # still running on the device

            def elapsed_time(self, other) -> float:
                return 0.0

            def synchronize(self) -> None:
                pass

        self.Event = Event

    def stream(self, name: str):
        """A fake stream called `name`."""
        return FakeStream(name, self.calls)

    def counts(self) -> Counter:
        """Calls so far by kind (event, record, query, wait, set_stream, and whatever callers counted)."""
        return Counter(self.calls)

    @contextmanager
    def installed(self):
        """torch.cuda's Event, set_stream and current_stream faked inside the block, and the offload streams'
        device reads served from the host."""
        def set_stream(stream) -> None:
            self.calls["set_stream"] += 1
        with attributes_set([torch.cuda], Event=self.Event, set_stream=set_stream,
                            current_stream=lambda device=None: self.compute), \
                attributes_set([streams_module], _current_stream_of=lambda index: (1, index, 1),
                               read_when_reached=lambda tensor: HostRead(tensor, None)):
            yield self

    def device_streams(self) -> DeviceStreams:
        """DeviceStreams on CPU memory that take the CUDA paths with this fake's streams (copies synchronous)."""
        streams = DeviceStreams(torch.device("cpu"))
        streams.cuda = True
        streams.copy_stream, streams.decode_stream = self.stream("copy"), self.stream("decode")
        return streams


class FakeStream:
    def __init__(self, name: str, calls: Counter) -> None:
        self.name, self.calls = name, calls

    def wait_event(self, event) -> None:
        assert event.stream is not None, f"{self.name} waits for an event that was never recorded"
        self.calls["wait"] += 1

    def synchronize(self) -> None:
        pass


@dataclass(frozen=True)
class HostPathOptions:
    """The stack and the runtime's switches, Specter's defaults unless set: experts per verify wave (`wave`; -1:
    every slot, 0: half the slots; None: as the runtime picks, every slot with pooled slots, else half), residual
    loads per decode launch (`group`), a decode group's copies issued together (`group_copies`), pooled_slots
    (`pooled`), resident experts per layer (`slots`), the shared spare rows (`spare_rows`), and the residual
    staging rows (`staging_rows`: as many as STAGING_BYTES holds of dsv2's longest calibrated blob, about 12 MB;
    the runtime caps a decode group there), and residual-coded slots (`coded`: the same memory as blob rows,
    rebuilt per wave into the scratch rows; Specter's default, off here so that the grouped-load switches apply:
    `coded=true` is the default runtime's path)."""

    layers: int = 26
    experts: int = 64
    top_k: int = 6
    tokens: int = 33
    slots: int = 4
    spare_rows: int = 4
    wave: int | None = None
    group: int = 8
    group_copies: bool = True
    pooled: int = 2  # pooled_slots: slots of each layer moved to the spare rows, lent to the layer verified
    staging_rows: int = 10
    coded: bool = False

    @property
    def verify_wave(self) -> int:
        """VerifyOptions.wave: `wave`, else every slot with pooled slots (-1), else half the slots (0)."""
        return self.wave if self.wave is not None else (-1 if self.pooled else 0)


class FakeResiduals:
    """What ExpertCache reads of a ResidualExpertStore: a small blob per expert, the experts of a layer end to end
    in one host buffer (as the store keeps them), a decode group launch that only counts itself."""

    max_blob_words = 48

    def __init__(self, options: HostPathOptions, calls: Counter) -> None:
        words = [40 + expert % 8 for expert in range(options.experts)]
        ends = torch.tensor(words).cumsum(0).tolist()
        buffers = [torch.zeros(ends[-1], dtype=torch.int32) for _ in range(options.layers)]
        self.blobs = [[buffer[end - size:end] for size, end in zip(words, ends)] for buffer in buffers]
        self.mean_blob_bytes, self.calls = 176.0, calls

    def blob(self, layer: int, expert: int) -> torch.Tensor:
        return self.blobs[layer][expert]

    def launcher(self):
        return SimpleNamespace(unbind=lambda: None)

    def decode(self, layer, expert, launcher, blob, out) -> None:  # a load's own decode (group 1)
        self.calls["decode_launch"] += 1

    def decode_group(self, layer, launcher, staging, pool, table) -> None:
        self.calls["decode_launch"] += 1


def build(options: HostPathOptions, fake: FakeCuda) -> ResidencyManager:
    """A residency manager over a cache of fp16 rows of a tiny expert shape, residual loads grouped."""
    store = HostExpertStore(options.layers, options.experts, 16, 8, torch.float16, torch.device("cpu"))
    for layer in range(options.layers):
        store.put_layer(layer, torch.zeros(options.experts, 16, 16, dtype=torch.float16),
                        torch.zeros(options.experts, 16, 8, dtype=torch.float16))
    pooled, residuals = options.pooled, FakeResiduals(options, fake.calls)  # pooled_slots: as the runtime moves them
    slots, spare, coded = options.slots - pooled, options.spare_rows + pooled * options.layers, None
    if options.coded:  # as the runtime converts the memory
        slots, spare, scratch = coded_rows(slots, spare, options.layers, options.experts, store.expert_bytes,
                                           residuals.max_blob_words * 4)
        coded = CodedSlots(residuals, options.layers * slots + spare, scratch, store.numel, store.dtype,
                           torch.device("cpu"))
    cache = ExpertCache(store, slots, torch.device("cpu"), fake.device_streams(), LRUPolicy(), spare,
                        residuals=residuals, decode_group=options.group, pooled=pooled > 0, coded=coded)
    cache.streams.group_copies = options.group_copies
    verify = VerifyOptions(wave=options.verify_wave)
    manager = ResidencyManager(cache, RoutingCounts(), verify, MoEWorkspace())
    manager.slot_kernel = False  # the waves' torch path, whose kernel is faked below
    return manager


def windows(options: HostPathOptions, count: int, seed: int = 0) -> list[tuple]:
    """(routing per layer [T, k], plan) per window: each layer routes among a skewed draw of its experts
    (about 47 distinct of 64 per window, as calibrated dsv2 loads), the plan lists them most routed first."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        routing, plan = [], {}
        for layer in range(options.layers):
            weights = torch.rand(options.experts, generator=gen) ** 2  # [E]
            top_k = torch.multinomial(weights.expand(options.tokens, -1), options.top_k, generator=gen)  # [T, k]
            routing.append(top_k)
            counts = Counter(top_k.reshape(-1).tolist())
            plan[layer] = [expert for expert, _ in counts.most_common()]
        out.append((routing, WindowPlan({}, Ranking.of(plan))))
    return out


def verify(manager: ResidencyManager, work: list[tuple], options: HostPathOptions) -> float:
    """Host seconds to verify every window of `work` (each layer through the manager, as a target forward)."""
    hidden, weights = torch.zeros(options.tokens, 16, dtype=torch.float16), torch.full(
        (options.tokens, options.top_k), 1.0 / options.top_k)
    modules = [SimpleNamespace(moe_layer=layer, num_experts=options.experts, intermediate_dim=8,
                               act_fn=torch.nn.functional.silu) for layer in range(options.layers)]
    start = time.perf_counter()
    for routing, plan in work:
        manager.cache.begin_window()
        planned = manager.window(plan)
        for layer, module in enumerate(modules):
            planned(module, hidden, routing[layer], weights)
        manager.take_demand()
    manager.cache.flush_loads()
    return time.perf_counter() - start


def measure(options: HostPathOptions, work: list[tuple], repeats: int = 3) -> dict:
    """Per MoE layer of a window: host us, loads, waves, decode launches and the CUDA calls the host makes (the
    fakes' records, queries, waits and stream switches, plus what the fakes do not see: each expert copy, the
    two kernel launches of a wave, each decode launch and each of their uploads, a copy and a record); us per
    load and per wave (the manager's own split). The fastest of `repeats` passes over `work` after a warm-up."""
    fake, best = FakeCuda(), None
    with faked(fake, options):
        manager = build(options, fake)
        verify(manager, work[:1], options)
        for _ in range(repeats):
            manager.reset()
            manager.cache.reset()
            manager.cache.streams.reset_stats()
            fake.calls.clear()
            gc.collect()
            seconds = verify(manager, work, options)
            if best is None or seconds < best[0]:
                best = (seconds, fake.counts(), manager.cache.counters.loads, manager.host_load_ms,
                        manager.host_wave_ms, manager.cache.streams.stats()["h2d_copy_calls"])
    seconds, counts, loads, load_ms, wave_ms, copies = best
    layers = len(work) * options.layers
    waves, decodes = counts["wave"], counts["decode_launch"]
    calls = {"records": counts["record"], "queries": counts["query"], "waits": counts["wait"],
             "stream_switches": counts["set_stream"], "copies": copies, "launches": 2 * waves + decodes,
             "uploads": 2 * (waves + decodes)}
    return {"us_per_layer": seconds * 1e6 / layers, "loads_per_layer": loads / layers,
            "waves_per_layer": waves / layers, "decode_launches_per_layer": decodes / layers,
            "us_per_load": load_ms * 1e3 / max(loads, 1), "us_per_wave": wave_ms * 1e3 / max(waves, 1),
            "cuda_calls_per_layer": sum(calls.values()) / layers,
            **{f"{kind}_per_layer": count / layers for kind, count in calls.items()}}


def profile(options: HostPathOptions, work: list[tuple], functions: int) -> None:
    """One pass over `work` under cProfile: the `functions` of most own time, printed."""
    fake = FakeCuda()
    with faked(fake, options):
        manager = build(options, fake)
        verify(manager, work[:1], options)
        profiler = cProfile.Profile()
        profiler.runcall(verify, manager, work, options)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(functions)


@contextmanager
def faked(fake: FakeCuda, options: HostPathOptions):
    """`fake` installed, the waves' kernel counted, and the staging buffer sized to `options.staging_rows` blobs."""
    staging = options.staging_rows * FakeResiduals.max_blob_words * 4  # int32 words
    with fake.installed(), attributes_set([residency_module], slot_moe_rows_reference=_counted_wave(fake.calls)), \
            attributes_set([streams_module], STAGING_BYTES=staging):
        yield


def _counted_wave(calls: Counter):
    def wave(hidden, top_k_index, pool, row_of_expert, intermediate, rows, act=None, *_, **__) -> None:
        calls["wave"] += 1
    return wave


def parse_variant(text: str) -> dict:
    """`wave=-1,group_copies=true` -> {"wave": -1, "group_copies": True} (HostPathOptions' field types)."""
    fields = {field.name: field.type for field in dataclasses.fields(HostPathOptions)}
    out = {}
    for pair in filter(None, text.split(",")):
        name, _, value = pair.partition("=")
        if name not in fields or not value:
            raise ValueError(f"unknown or empty option {pair!r}; options: {', '.join(fields)}")
        out[name] = value.lower() in ("1", "true", "yes") if fields[name] in (bool, "bool") else int(value)
    return out


CALL_KINDS = ("records", "queries", "waits", "stream_switches", "copies", "launches", "uploads")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=int, default=20, help="windows per pass (default 20)")
    parser.add_argument("--repeats", type=int, default=3, help="passes per variant, the fastest kept (default 3)")
    parser.add_argument("--variants", nargs="*", default=[], help="key=value[,key=value] HostPathOptions each")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also print each variant's N functions of most own time (cProfile, one pass)")
    args = parser.parse_args(argv)
    try:
        variants = [("defaults", {})] + [(text, parse_variant(text)) for text in args.variants]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.windows < 1 or args.repeats < 1:
        print("error: --windows and --repeats must be >= 1", file=sys.stderr)
        return 2
    work = windows(HostPathOptions(), args.windows)
    rows = {}
    for label, fields in variants:
        options = dataclasses.replace(HostPathOptions(), **fields)
        rows[label] = measure(options, work, args.repeats)
        if args.profile:
            print(f"== {label}: own time per function")
            profile(options, work, args.profile)
    print(f"host path on CPU, CUDA faked: {args.windows} windows x {HostPathOptions().layers} layers, "
          f"fastest of {args.repeats}")
    for label, row in rows.items():
        print(f"{label}: {row['us_per_layer']:.0f} us per layer; {row['loads_per_layer']:.1f} loads "
              f"({row['us_per_load']:.1f} us each), {row['waves_per_layer']:.1f} waves ({row['us_per_wave']:.1f} us "
              f"each), {row['decode_launches_per_layer']:.1f} decode launches; {row['cuda_calls_per_layer']:.0f} CUDA "
              "calls: " + ", ".join(f"{kind.replace('_', ' ')} {row[kind + '_per_layer']:.0f}" for kind in CALL_KINDS))
    base = rows["defaults"]["us_per_layer"]
    for label, row in list(rows.items())[1:]:
        print(f"{label}: {row['us_per_layer'] / base:.3f}x the defaults' host us per layer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
