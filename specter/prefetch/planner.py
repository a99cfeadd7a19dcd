"""Layer-aware prefetch planner: chunked draft-time prefetch (Cold Start, Prefetch Overlap, Final Cleanup)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from specter.offload.expert_cache import ExpertCache
from specter.prefetch.lookahead import PatternAnalyzer, Ranking

INITIAL_CHUNK = 1  # draft tokens of the Cold Start chunk (observed before the first prefetch)
PREFETCH_CHUNK = 1  # draft steps whose compute one prefetch batch's transfer may span (a batch per draft token)
EARLY_READ_FRACTION = 0.15  # the Cold Start's last step reports its first ceil(0.15 x MoE layers) layers early

Rows = dict[int, list[tuple[int, int]]]  # layer -> [(expert, count)], most routed first

COLD_START, PREFETCH_OVERLAP, FINAL_CLEANUP = "cold_start", "prefetch_overlap", "final_cleanup"
DEFAULT_H2D_BYTES_PER_MS = 25e6  # 25 GB/s until measured


@dataclass
class CostModel:
    """Running averages (exponential, weight `alpha` on the newest) of draft ms/token and H2D bytes/ms."""

    draft_ms_per_token: float = 5.0
    h2d_bytes_per_ms: float = DEFAULT_H2D_BYTES_PER_MS
    alpha: float = 0.5
    frozen: bool = False  # tests: keep the given numbers

    def observe_draft(self, ms: float, tokens: int) -> None:
        if tokens > 0 and ms > 0 and not self.frozen:
            self.draft_ms_per_token += self.alpha * (ms / tokens - self.draft_ms_per_token)

    def observe_bandwidth(self, bytes_per_ms: float | None) -> None:
        if bytes_per_ms and not self.frozen:
            self.h2d_bytes_per_ms += self.alpha * (bytes_per_ms - self.h2d_bytes_per_ms)

    def chunk_tokens(self, batch_bytes: int) -> int:
        """Draft tokens whose compute ~ the H2D time of a batch of `batch_bytes` (at least 1)."""
        transfer_ms = batch_bytes / self.h2d_bytes_per_ms
        return max(1, math.ceil(transfer_ms / self.draft_ms_per_token))


@dataclass
class WindowTrace:
    """What the planner did in one draft window (for inspection and stats)."""

    k: int
    boundaries: list[int] = field(default_factory=list)  # drafted-token counts where it planned
    phases: list[str] = field(default_factory=list)  # phase entered at each boundary
    batch_sizes: list[int] = field(default_factory=list)  # experts issued at each boundary
    early_batch: int = 0  # experts issued from the Cold Start's early layers (before its last step ends)
    planned: dict = field(default_factory=dict)  # layer -> experts planned in this window

    def as_dict(self) -> dict:
        return {"k": self.k, "boundaries": self.boundaries, "phases": self.phases, "batches": self.batch_sizes,
                "early_batch": self.early_batch}


@dataclass(frozen=True)
class WindowPlan:
    """What one draft window hands to its verification: the experts prefetched for it and the draft's
    routing of the whole window (verification loads a layer's ranked experts after its resident wave,
    most routed first, and a load ahead keeps them)."""

    prefetched: dict  # layer -> frozenset of experts prefetched (or kept resident) for this window
    ranking: Ranking | None = None  # None: verification loads on demand only

    def load_order(self, layer: int) -> list[int]:
        """The experts verification loads for `layer` before reading its router, most routed first."""
        return self.ranking.experts(layer) if self.ranking is not None else []

    def draft_counts(self, layer: int) -> dict[int, int]:
        """Expert -> how many of the window's draft tokens routed to it at `layer` (0: count unknown)."""
        return dict(self.ranking.rows().get(layer, ())) if self.ranking is not None else {}

    @classmethod
    def of(cls, trace: WindowTrace, ranking: Ranking | None = None) -> WindowPlan:
        return cls({layer: frozenset(experts) for layer, experts in trace.planned.items()}, ranking)


class PrefetchPlanner:
    """Turns the draft's routing into H2D batches that overlap with the remaining draft compute.

    Cold Start: the first chunk (`initial_chunk` tokens) only observes, except that when the counters
    have a tap (ExpertLookaheadBuffer.set_tap) the chunk's last step has its early layers planned as
    soon as it has routed them, in one batch the rest of that step can hide. At each boundary the counters
    are read in the background; once the next draft step is queued, the analyzer's top-M plan
    (M = slots per layer) minus the resident experts is issued as one batch on the copy stream, most
    frequently routed experts first and no more than `prefetch_chunk` draft steps can hide, and the
    next boundary is set so the next chunk's draft time ~ that batch's transfer time (Prefetch
    Overlap). Small batches issued late evict fewer experts that the rest of the window turns out to
    need: each victim is an expert the draft has not routed to yet, and the later the batch, the less
    likely the remaining draft steps route to it. Once every slot holds a
    planned expert or the draft is over, Final Cleanup: no more planning. At the end of the window the
    counters hold the draft's routing of the whole window: `end_window` returns it, with the window's
    prefetches, as the WindowPlan the engine hands to verification (the experts it loads after its
    resident wave, before reading its router), and the counters are cleared.
    """

    def __init__(self, analyzer: PatternAnalyzer, cache: ExpertCache, *, initial_chunk: int, prefetch_chunk: int,
                 cost: CostModel | None = None, clock=time.perf_counter) -> None:
        self.analyzer, self.cache, self.cost = analyzer, cache, cost or CostModel()
        self.initial_chunk, self.prefetch_chunk, self.clock = initial_chunk, prefetch_chunk, clock
        self.traces: list[WindowTrace] = []
        self.trace = WindowTrace(0)

    def begin_request(self, cache: ExpertCache) -> None:
        """A request starts on `cache`: no traces yet (the cost model carries over)."""
        self.cache, self.traces = cache, []

    def begin_window(self, k: int) -> None:
        self.trace = WindowTrace(k)
        self.phase, self.next_boundary, self.last_boundary = COLD_START, self.initial_chunk, 0
        self.last_time, self.pending = self.clock(), None

    def after_draft_token(self, drafted: int) -> None:
        """Called once draft step `drafted` is enqueued: issue the batch read at the previous boundary (its
        copies overlap with this step), and start reading the counters at a boundary."""
        if self.pending is not None:
            self._checkpoint(*self.pending)
        if self.phase != FINAL_CLEANUP and drafted == self.next_boundary and drafted < self.trace.k:
            if self.phase == COLD_START:
                self._early_batch()
            self.pending = (drafted, self.analyzer.read_later(self.cache.streams))

    def end_window(self) -> WindowPlan:
        """The window's plan: its prefetches and its routing (read lazily) for verification; the counters
        are cleared."""
        if self.pending is not None:
            self._checkpoint(*self.pending)
        self.phase = FINAL_CLEANUP
        ranking = self.analyzer.read_later(self.cache.streams)
        self.analyzer.elb.clear()
        self.traces.append(self.trace)
        return WindowPlan.of(self.trace, ranking)

    def _checkpoint(self, drafted: int, ranking: Ranking) -> None:
        self.pending = None
        rows = ranking.rows()  # the host waits for the copy; the next draft step is already queued
        now = self.clock()
        self.cost.observe_draft((now - self.last_time) * 1e3, drafted - self.last_boundary)
        self.cost.observe_bandwidth(self.cache.streams.measured_bandwidth())
        self.last_time, self.last_boundary = now, drafted
        batch = self._issue(rows, self._capacity(min(self.prefetch_chunk, self.trace.k - drafted)))
        full = all(len(planned & self.cache.resident_experts(layer)) >= self.cache.slots_per_layer
                   for layer, planned in self.trace.planned.items())
        chunk = self.cost.chunk_tokens(batch * self.cache.load_bytes)
        self.next_boundary = drafted + min(chunk, self.prefetch_chunk)  # at most one sync per draft token
        self.phase = FINAL_CLEANUP if full or self.next_boundary >= self.trace.k else PREFETCH_OVERLAP
        self.trace.boundaries.append(drafted)
        self.trace.phases.append(self.phase)
        self.trace.batch_sizes.append(batch)

    def _early_batch(self) -> None:
        """The Cold Start's last step's early layers, read mid-step through the counters' tap (if any):
        their planned experts go out while the step computes its later layers."""
        rows = self.analyzer.early_rows()  # the host waits until the step has counted the tapped layers
        if rows:
            rest_of_step = 1 - len(rows) / len(self.cache.layers)
            self.trace.early_batch = self._issue(rows, self._capacity(rest_of_step))

    def _capacity(self, tokens: float) -> int:
        """Experts whose transfer `tokens` draft steps can hide (rounded up: the copy stream never idles)."""
        hidden_ms = tokens * self.cost.draft_ms_per_token
        return max(1, math.ceil(hidden_ms * self.cost.h2d_bytes_per_ms / self.cache.load_bytes))

    def _issue(self, rows: Rows, capacity: int) -> int:
        """Prefetch up to `capacity` planned experts, most routed first (`issue_prefetches`), keeping every
        expert the window's draft has routed to so far; returns how many were issued."""
        predicted = {layer: frozenset(e for e, _ in row) for layer, row in rows.items()}
        return issue_prefetches(self.cache, rows, self.trace.planned, predicted, capacity)


def issue_prefetches(cache: ExpertCache, rows: Rows, planned: dict, predicted: dict | None = None,
                     capacity: int | None = None, most_routed_first: bool = True) -> int:
    """Prefetch each layer's top-M ranked experts (M = slots per layer) that are not resident; returns how
    many copies started.

    The plan's resident experts are touched first (most recently used), so the victims of the new
    copies lie outside the plan. `planned` (layer -> set, updated) holds what this window has planned:
    a copy never evicts it, nor an expert of `predicted` (layer -> experts). most_routed_first: every
    resident planned expert joins `planned` before any copy, and the copies go most routed first over
    all layers, at most `capacity` of them; otherwise layer by layer in rank order, each expert joining
    `planned` when its turn comes.
    """
    predicted = predicted or {}
    top = {layer: row[: cache.slots_per_layer] for layer, row in rows.items()}
    for layer, row in top.items():
        for expert, _ in row:
            cache.touch(layer, expert)
    candidates = [(-count, layer, expert) for layer, row in top.items() for expert, count in row]
    if most_routed_first:
        candidates.sort(key=lambda c: (cache.slot_of(c[1], c[2]) is None, *c))  # resident first, then by count
    issued = tried = 0
    for _, layer, expert in candidates:
        if cache.slot_of(layer, expert) is not None:
            planned.setdefault(layer, set()).add(expert)
            continue
        if capacity is not None and tried == capacity:
            continue
        tried += 1
        keep = frozenset(planned.get(layer, ()))
        if cache.prefetch(layer, expert, keep, predicted.get(layer, frozenset())):
            planned.setdefault(layer, set()).add(expert)
            issued += 1
    cache.flush_loads()  # grouped residual loads: the last group decodes now, not when verification needs it
    return issued


def early_read_layer(fraction: float, num_layers: int) -> int | None:
    """The last MoE layer of the first draft step's early read (None: off, or it would be the whole step)."""
    layer = math.ceil(fraction * num_layers) - 1
    return layer if 0 <= layer < num_layers - 1 else None


class NoPrefetch:
    """The planner when prefetch is off or nothing is offloaded: on-demand loading only, no plan."""

    def __init__(self) -> None:
        self.traces: list[WindowTrace] = []  # always empty

    def begin_request(self, cache: ExpertCache | None) -> None:
        pass

    def begin_window(self, k: int) -> None:
        pass

    def after_draft_token(self, drafted: int) -> None:
        pass

    def end_window(self) -> None:
        return None
