"""Layer-aware prefetch planner: chunked draft-time prefetch (Cold Start, Prefetch Overlap, Final Cleanup)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from specter.offload.expert_cache import ExpertCache
from specter.prefetch.lookahead import PatternAnalyzer, Ranking

COLD_START, PREFETCH_OVERLAP, FINAL_CLEANUP = "cold_start", "prefetch_overlap", "final_cleanup"


@dataclass
class CostModel:
    """Running averages (exponential, weight `alpha` on the newest) of draft ms/token and H2D bytes/ms."""

    draft_ms_per_token: float = 5.0
    h2d_bytes_per_ms: float = 25e6  # 25 GB/s until measured
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
    counters hold the draft's routing of the whole window: it becomes the cache's verification plan
    (experts that verification loads, after its resident wave, before reading its router), and the
    counters are cleared.
    """

    def __init__(self, analyzer: PatternAnalyzer, cache: ExpertCache, cost: CostModel | None = None,
                 initial_chunk: int = 1, clock=time.perf_counter, prefetch_chunk: int = 1) -> None:
        self.analyzer, self.cache, self.cost = analyzer, cache, cost or CostModel()
        self.initial_chunk, self.prefetch_chunk, self.clock = initial_chunk, prefetch_chunk, clock
        self.traces: list[WindowTrace] = []
        self.trace = WindowTrace(0)

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

    def end_window(self) -> WindowTrace:
        """The window's routing becomes the verification plan (read lazily); clear the counters."""
        if self.pending is not None:
            self._checkpoint(*self.pending)
        self.phase = FINAL_CLEANUP
        self.cache.verify_plan = self.analyzer.read_later(self.cache.streams)
        self.analyzer.elb.clear()
        self.cache.predicted, self.cache.window_plan = {}, {}
        self.traces.append(self.trace)
        return self.trace

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
        chunk = self.cost.chunk_tokens(batch * self.cache.store.expert_bytes)
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
        return max(1, math.ceil(hidden_ms * self.cost.h2d_bytes_per_ms / self.cache.store.expert_bytes))

    def _issue(self, rows: dict[int, list[tuple[int, int]]], capacity: int) -> int:
        """Prefetch up to `capacity` planned experts that are not resident; returns how many were issued.

        The plan is each layer's top-M; its non-resident experts go most frequently routed first.
        Planned experts already resident are touched first (most recently used), so the LRU victims of
        the new copies are experts outside the plan; and an expert prefetched earlier in this window is
        never evicted by a later batch of the same window (its slot is kept until verification).
        """
        self.cache.predicted = {layer: {e for e, _ in row} for layer, row in rows.items()}
        self.cache.window_plan = self.trace.planned
        wanted = []
        for layer, row in rows.items():
            for expert, count in row[: self.cache.slots_per_layer]:
                if self.cache.slot_of(layer, expert) is None:
                    wanted.append((-count, layer, expert))
                else:
                    self.cache.touch(layer, expert)
                    self.trace.planned.setdefault(layer, set()).add(expert)
        issued = 0
        for _, layer, expert in sorted(wanted)[:capacity]:
            if self.cache.prefetch(layer, expert):
                self.trace.planned.setdefault(layer, set()).add(expert)
                issued += 1
        return issued

    def reset(self) -> None:
        self.traces = []


def early_read_layer(fraction: float, num_layers: int) -> int | None:
    """The last MoE layer of the first draft step's early read (None: off, or it would be the whole step)."""
    layer = math.ceil(fraction * num_layers) - 1
    return layer if 0 <= layer < num_layers - 1 else None


class NoPrefetch:
    """The planner when prefetch is off or nothing is offloaded: on-demand loading only."""

    traces: list = []

    def begin_window(self, k: int) -> None:
        pass

    def after_draft_token(self, drafted: int) -> None:
        pass

    def end_window(self) -> WindowTrace | None:
        return None

    def reset(self) -> None:
        pass
