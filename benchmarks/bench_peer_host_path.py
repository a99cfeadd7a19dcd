"""The peers' host work per token (MO-SC/SM, SpecMoEOff-SC/SM) on a dsv2-shaped stack, on CPU with CUDA faked."""
from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import sys
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from baselines.mixtral_offloading import STAGING_BUFFERS, SwapCache, SwapExecutor, same_memory_slots  # noqa: E402
from baselines.specmoeoff.k_optimizer import CostModel, best_k  # noqa: E402
from baselines.specmoeoff.memory_policy import matched_memory_slots  # noqa: E402
from baselines.specmoeoff.prefetch import FixedPositionPrefetch  # noqa: E402
from benchmarks.bench_host_path import FakeCuda  # noqa: E402
from benchmarks.row_log import RowLog  # noqa: E402
from specter.kernels.moe_align import MoEWorkspace  # noqa: E402
from specter.models.loading import hf_config  # noqa: E402
from specter.models.registry import get_spec  # noqa: E402
from specter.device.budget import plan_memory  # noqa: E402
from specter.offload.eviction import LRUPolicy, RoutingCounts  # noqa: E402
from specter.offload.expert_cache import ExpertCache  # noqa: E402
from specter.offload.host_store import HostExpertStore  # noqa: E402
from specter.offload.runtime import SPARE_ROWS  # noqa: E402
from specter.prefetch.lookahead import ExpertLookaheadBuffer, PatternAnalyzer  # noqa: E402
from specter.speculative.window import draft_window  # noqa: E402
from specter.verify.residency import ResidencyManager, VerifyOptions  # noqa: E402
from specter.window_accounting import WindowAccounting  # noqa: E402

MEMS = {"high": 16, "low": 4}  # dsv2's Specter slots per layer (the registry's mem presets)
SYSTEMS = ("mo_sc", "mo_sm", "specmoeoff_sc", "specmoeoff_sm")
CALL_KINDS = ("records", "queries", "waits", "stream_switches", "copies", "launches", "host_reads")


@dataclass(frozen=True)
class Stack:
    """DeepSeek-V2-Lite's routed experts (26 MoE layers, 64 experts, top-6) with tiny expert tensors; SpecMoEOff's
    windows: `k` drafts, `accepted` of them accepted (a window commits accepted + 1 tokens: about what its H200
    runs on dsv2 commit, 64 tokens in 15 to 25 windows)."""

    layers: int = 26
    experts: int = 64
    top_k: int = 6
    hidden: int = 16
    intermediate: int = 8
    k: int = 8
    accepted: int = 2
    dsv2_expert_bytes: int = 3 * 1408 * 2048 * 2  # one fp16 dsv2 expert: a load's bytes on the real model


def dsv2_slots() -> dict[tuple[str, str], int]:
    """(system, mem) -> FP slots per layer, as the harness's factories give them for dsv2 in fp16."""
    spec = get_spec("dsv2")
    plan = plan_memory(spec, hf_config(spec), torch.float16)
    out = {}
    for mem, slots in MEMS.items():
        out.update({("mo_sc", mem): slots, ("mo_sm", mem): same_memory_slots(slots, plan),
                    ("specmoeoff_sc", mem): slots, ("specmoeoff_sm", mem): matched_memory_slots(plan, slots)})
    return out


def routing(stack: Stack, tokens: int, seed: int = 0) -> list[list[torch.Tensor]]:
    """Per token, per layer its top-k [1, k]: each layer draws from a skewed popularity of its experts (MO's hit
    rates come out near the H200 tables' on dsv2: 0.10 / 0.40 / 0.49 / 0.68 with 4 / 16 / 20 / 32 slots)."""
    gen = torch.Generator().manual_seed(seed)
    per_layer = []
    for _ in range(stack.layers):
        weights = torch.rand(stack.experts, generator=gen) ** 2  # [E]
        per_layer.append(torch.multinomial(weights.expand(tokens, -1), stack.top_k, generator=gen))  # [N, k]
    return [[per_layer[layer][t:t + 1] for layer in range(stack.layers)] for t in range(tokens)]


def host_store(stack: Stack) -> HostExpertStore:
    store = HostExpertStore(stack.layers, stack.experts, stack.hidden, stack.intermediate, torch.float32,
                            torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    for layer in range(stack.layers):
        store.put_layer(layer, torch.randn(stack.experts, 2 * stack.intermediate, stack.hidden, generator=gen),
                        torch.randn(stack.experts, stack.hidden, stack.intermediate, generator=gen))
    return store


def modules(stack: Stack) -> list[SimpleNamespace]:
    return [SimpleNamespace(moe_layer=layer, num_experts=stack.experts, intermediate_dim=stack.intermediate,
                            act_fn=torch.nn.functional.silu) for layer in range(stack.layers)]


class MOPeer:
    """MO's SwapExecutor over a SwapCache of `slots` per layer, decoding token by token (one [1, H] hidden)."""

    def __init__(self, stack: Stack, slots: int, fake: FakeCuda, store: HostExpertStore) -> None:
        self.stack, self.cache = stack, SwapCache(store, slots, torch.device("cpu"), STAGING_BUFFERS)
        self.cache.streams = fake.device_streams()
        self.executor, self.modules = SwapExecutor(self.cache, STAGING_BUFFERS - 1), modules(stack)
        self.weights = torch.full((1, stack.top_k), 1.0 / stack.top_k)
        self.phases: Counter = Counter()

    def reset(self) -> None:
        self.cache.reset()

    def prepare(self, work: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        return work  # token by token

    def run(self, work: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """Decode every token of `work`: each layer's experts through the executor; every layer's output."""
        hidden, outs = torch.ones(1, self.stack.hidden), []
        for token in work:
            outs += [self.executor(module, hidden, top_k_index, self.weights)
                     for module, top_k_index in zip(self.modules, token)]
        return outs

    def loads(self) -> int:
        return self.cache.counters["misses"]

    def tokens(self, work: list) -> int:
        return len(work)

    def bench_ops(self, work: list) -> int:
        """Aten ops of the bench's own in `run` (not the peer's)."""
        return 1

    @property
    def streams(self):
        return self.cache.streams


class SpecMoEOffPeer:
    """SpecMoEOff's window minus the two models' forwards, as its engine runs it: K by the cost model, the
    draft's routing counted (the ELB) with the fixed-position prefetch after draft steps 1 and 2, the target's
    token-wise verify of K + 1 positions through an LRU ExpertCache, the window's accounting and cost update."""

    def __init__(self, stack: Stack, slots: int, fake: FakeCuda, store: HostExpertStore) -> None:
        self.stack, cpu = stack, torch.device("cpu")
        cache = ExpertCache(store, slots, cpu, fake.device_streams(), LRUPolicy(), SPARE_ROWS)
        self.manager = ResidencyManager(cache, RoutingCounts(), VerifyOptions(expert_wise=False), MoEWorkspace())
        self.elb = ExpertLookaheadBuffer(stack.layers, stack.experts, cpu)
        self.prefetcher = FixedPositionPrefetch(PatternAnalyzer(self.elb), cache, (1, 2))
        session = SimpleNamespace(cache=cache, streams=cache.streams, residency=self.manager)
        self.accounting, self.modules = WindowAccounting(session), modules(stack)
        self.weights = torch.full((stack.k + 1, stack.top_k), 1.0 / stack.top_k)
        self.phases: Counter = Counter()
        self.reset()

    def reset(self) -> None:
        self.manager.reset()
        self.manager.cache.reset()
        self.prefetcher.begin_request(self.manager.cache)
        self.elb.clear()
        self.costs = CostModel(self.stack.layers, self.stack.experts, self.stack.top_k)
        self.phases.clear()

    def prepare(self, work: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Windows of K + 1 consecutive tokens of `work`: per window, per layer the routing [K + 1, k]."""
        span = self.stack.k + 1
        return [[torch.cat(layer) for layer in zip(*work[start:start + span])]
                for start in range(0, len(work) - span + 1, span)]

    def run(self, windows: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """Every window of `windows` (`prepare`); every layer's verify output."""
        hidden, outs = torch.ones(self.stack.k + 1, self.stack.hidden), []
        for routes in windows:
            outs += self.window(hidden, routes)
        return outs

    def window(self, hidden: torch.Tensor, routes: list[torch.Tensor]) -> list[torch.Tensor]:
        """One window over `routes` (per layer [K + 1, k]), the draft's routing that of the first K positions
        (counted into the ELB as the draft's forward does: inside its CUDA graph on the GPU, so timed apart)."""
        k, cache, clock = self.stack.k, self.manager.cache, time.perf_counter
        t0 = clock()
        best_k(self.costs, 32)  # the engine's choose_k (the window keeps the bench's K: the same loads each run)
        self.accounting.begin_window()
        loads, routing_s = cache.counters.loads, 0.0
        t1 = clock()

        def draft_step(step: int, previous) -> None:  # the draft's routing of position `step`, timed apart
            nonlocal routing_s
            start = clock()
            for layer, top_k_index in enumerate(routes):
                self.elb.observe(layer, top_k_index[step:step + 1])
            routing_s += clock() - start

        _, plan = draft_window(k, draft_step, self.prefetcher, nullcontext)
        t2 = clock()
        verify = self.manager.window(plan)
        outs = [verify(module, hidden, top_k_index, self.weights)
                for module, top_k_index in zip(self.modules, routes)]
        t3 = clock()
        self.accounting.close_window(plan)
        bandwidth = cache.streams.measured_bandwidth()
        self.costs.observe(k, self.stack.accepted, 50.0, cache.counters.loads - loads, draft_ms=5.0,
                           load_ms=cache.store.expert_bytes / bandwidth if bandwidth else None)
        t4 = clock()
        self.phases.update(k_and_accounting=(t1 - t0) + (t4 - t3), prefetch=t2 - t1 - routing_s, verify=t3 - t2,
                           draft_routing=routing_s)
        return outs

    def loads(self) -> int:
        return self.manager.cache.counters.loads

    def tokens(self, windows: list) -> int:
        return len(windows) * (self.stack.accepted + 1)  # committed tokens

    def bench_ops(self, windows: list) -> int:
        """Aten ops of the bench's own in `run`: the hidden state, and the draft routing's counts (`window`)."""
        return 1 + len(windows) * self.stack.k * self.stack.layers

    @property
    def streams(self):
        return self.manager.cache.streams


PEERS = {"mo_sc": MOPeer, "mo_sm": MOPeer, "specmoeoff_sc": SpecMoEOffPeer, "specmoeoff_sm": SpecMoEOffPeer}


class OpCounter(TorchDispatchMode):
    """Every aten op that is not a view (about one kernel launch each on CUDA), by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket is not torch.ops.aten.item:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class ReadCounter(TorchFunctionMode):
    """Host reads of tensor values (tolist, item: each a device sync on CUDA)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.tolist, torch.Tensor.item):
            self.reads += 1
        return func(*args, **(kwargs or {}))


def measure(system: str, slots: int, stack: Stack, work: list, repeats: int = 3) -> dict:
    """Per committed token: host us (the fastest of `repeats` passes after a warm-up; SpecMoEOff's without the
    draft routing's counts, by phase too), expert loads, H2D bytes and CUDA calls by kind (the fakes' records,
    queries, waits and stream switches, the copies, and from one more pass the launches and host reads)."""
    fake = FakeCuda()
    with fake.installed(), torch.inference_mode():
        peer = PEERS[system](stack, slots, fake, host_store(stack))
        jobs = peer.prepare(work)
        peer.run(jobs[:2])  # warm-up
        best = None
        for _ in range(repeats):
            peer.reset()
            peer.streams.reset_stats()
            fake.calls.clear()
            gc.collect()
            start = time.perf_counter()
            outs = peer.run(jobs)
            seconds = time.perf_counter() - start - peer.phases.pop("draft_routing", 0.0)
            if best is None or seconds < best[0]:
                best = (seconds, fake.counts(), peer.loads(), peer.streams.copied_bytes(),
                        peer.streams.stats()["h2d_copy_calls"], dict(peer.phases), outs)
        peer.reset()
        peer.streams.reset_stats()
        with ReadCounter() as reads, OpCounter() as ops:
            peer.run(jobs)
    seconds, counts, loads, nbytes, copies, phases, outs = best
    tokens = peer.tokens(jobs)
    calls = {"records": counts["record"], "queries": counts["query"], "waits": counts["wait"],
             "stream_switches": counts["set_stream"], "copies": copies,
             "launches": sum(ops.ops.values()) - copies - peer.bench_ops(jobs), "host_reads": reads.reads}
    return {"system": system, "slots": slots, "tokens": tokens, "us_per_token": seconds * 1e6 / tokens,
            **{f"{phase}_us_per_token": s * 1e6 / tokens for phase, s in sorted(phases.items())},
            "loads_per_token": loads / tokens, "h2d_bytes_per_token": nbytes / tokens,
            "dsv2_h2d_bytes_per_token": loads * stack.dsv2_expert_bytes / tokens,
            "cuda_calls_per_token": sum(calls.values()) / tokens,
            **{f"{kind}_per_token": count / tokens for kind, count in calls.items()},
            "checksum": float(sum(out.double().sum() for out in outs))}  # equal outputs before and after a change


def profile(system: str, slots: int, stack: Stack, work: list, functions: int) -> None:
    """One pass under cProfile: the `functions` of most own time, printed."""
    fake = FakeCuda()
    with fake.installed(), torch.inference_mode():
        peer = PEERS[system](stack, slots, fake, host_store(stack))
        jobs = peer.prepare(work)
        peer.run(jobs[:2])
        peer.reset()
        profiler = cProfile.Profile()
        profiler.runcall(peer.run, jobs)
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(functions)


def print_row(label: str, row: dict) -> None:
    calls = ", ".join(f"{kind.replace('_', ' ')} {row[kind + '_per_token']:.1f}" for kind in CALL_KINDS)
    phases = "".join(f"; {key[:-13].replace('_', ' ')} {row[key]:.0f} us"
                     for key in row if key.endswith("_us_per_token") and key != "us_per_token")
    print(f"{label}: {row['us_per_token']:.0f} us per token{phases}; {row['loads_per_token']:.2f} loads "
          f"({row['dsv2_h2d_bytes_per_token'] / 1e6:.1f} MB on dsv2, {row['h2d_bytes_per_token']:.0f} B here); "
          f"{row['cuda_calls_per_token']:.0f} CUDA calls: {calls}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=90, help="decoded positions per pass (default 90)")
    parser.add_argument("--repeats", type=int, default=3, help="passes per system, the fastest kept (default 3)")
    parser.add_argument("--systems", nargs="*", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--mems", nargs="*", default=list(MEMS), choices=list(MEMS))
    parser.add_argument("--out", type=Path, default=None, help="CSV of the rows, written row by row")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also print each system's N functions of most own time (cProfile, one pass)")
    args = parser.parse_args(argv)
    stack = Stack()
    if args.tokens < stack.k + 1 or args.repeats < 1:
        print(f"error: --tokens must be >= {stack.k + 1} and --repeats >= 1", file=sys.stderr)
        return 2
    work, slots = routing(stack, args.tokens), dsv2_slots()
    log = RowLog(args.out) if args.out else None
    print(f"peer host path on CPU, CUDA faked: {args.tokens} positions x {stack.layers} layers, fastest of "
          f"{args.repeats}; SpecMoEOff windows of K={stack.k}, {stack.accepted + 1} tokens committed each")
    for mem in args.mems:
        for system in args.systems:
            label = f"{system} dsv2-{mem} ({slots[system, mem]} slots)"
            if args.profile:
                print(f"== {label}: own time per function")
                profile(system, slots[system, mem], stack, work, args.profile)
            row = measure(system, slots[system, mem], stack, work, args.repeats)
            if log:
                log.add({"mem": mem, **row}, workload=f"dsv2-shaped {stack.layers}x{stack.experts} top-"
                        f"{stack.top_k}, {args.tokens} positions, K={stack.k}")
            print_row(label, row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
