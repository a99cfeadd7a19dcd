"""One request's offload accounting, window by window: prefill bytes, window misses, working sets, prefetch quality."""
from __future__ import annotations

from specter.metrics import DecodeMetrics, h2d_split
from specter.device.trace_overlap import copy_idle_by_phase
from specter.prefetch.quality import PrefetchQuality
from specter.token_time import request_token_time


class WindowAccounting:
    """What one request moved against what it had to move (nothing when `session` is None: all resident).

    Per verify window: the experts resident when it begins; when it closes, the target's routing gives
    the working set, the window's misses (routed experts that were not resident at its start: bytes no
    schedule from that cache could avoid) and, against the window's plan, the prefetch precision and recall.
    """

    def __init__(self, session=None) -> None:
        self.session = session  # the offload.runtime.OffloadSession of the call, or None
        self.quality = PrefetchQuality()
        self.window_miss_bytes = self.prefill_h2d_bytes = 0
        self.window_sets: list[float] = []  # per verify window: distinct experts per layer (mean over layers)
        self._resident_at_start: list[set] = []

    def end_prefill(self) -> None:
        """The prefill's routing is not a verify window; its copies are counted apart from decoding's."""
        if self.session is not None:
            self.session.residency.take_demand()
            self.prefill_h2d_bytes = self.session.streams.copied_bytes()

    def begin_window(self) -> None:
        """Which experts are resident as a window begins (for its misses)."""
        if self.session is not None:
            cache = self.session.cache
            self._resident_at_start = [cache.resident_experts(layer) for layer in range(len(cache.layers))]

    def close_window(self, plan=None) -> dict[int, set]:
        """After a verify pass: the target's routing (layer -> experts, returned) against the window's plan
        (prefetch.planner.WindowPlan; None: nothing planned), its working set and its misses."""
        if self.session is None:
            return {}
        routed = self.session.residency.take_demand()
        if routed:
            self.window_sets.append(sum(len(s) for s in routed.values()) / len(routed))
        if plan is not None:
            self.quality.add(plan.prefetched, routed)
        missing = sum(len(experts - self._resident_at_start[layer]) for layer, experts in routed.items())
        self.window_miss_bytes += missing * self.session.cache.load_bytes
        return routed

    def skip_window(self) -> None:
        """Close a window without accounting for it (its routing is dropped)."""
        if self.session is not None:
            self.session.residency.take_demand()

    def stats(self, metrics: DecodeMetrics, traces: list, copy_idle: bool = False) -> dict:
        """The request's stats: `metrics`' summary and, when offloaded, the cache's and this accounting's
        (`traces`: the planner's window traces; copy_idle: where the copy stream idled, by phase)."""
        stats = metrics.summary()
        stats.update(request_token_time(metrics, None if self.session is None else self.session.streams))
        if self.session is None:
            return stats
        stats.update(self.session.stats())
        h2d_split(stats, self.prefill_h2d_bytes, stats["generated_tokens"] - 1)  # decode bytes: compare with misses
        stats.update(self.quality.stats())
        stats["prefetch_trace"] = [t.as_dict() for t in traces]
        stats["window_miss_bytes"] = self.window_miss_bytes
        if copy_idle:
            streams = self.session.streams
            stats.update(copy_idle_by_phase(streams.copy_spans_ms(metrics.timeline), metrics.phase_spans_ms()))
        stats["window_working_sets"] = list(self.window_sets)
        return stats

