"""Where each committed token's time went, from CUDA events on the compute stream: the tpot_* columns.

Between a request's first and last commit (what TPOT divides), every millisecond of the compute stream's
timeline falls in one of five parts, so that they sum to TPOT:

- draft: the draft phase of each window (drafting on the critical path; ~0 where drafted ahead),
- copy_wait: the target pass stalled on expert copies (`wait_event` on a copy, timed by two events),
- rebuild: the target pass rebuilding residual experts, on the compute stream or stalled on the decode stream's
  rebuild of the expert it waits for (`CopyLog.critical_path_ms`),
- target: the rest of the target pass (verify for Specter, the decode forward for the peers): its kernels, and
  the host's launches and reads inside the pass where the GPU waits for them,
- host: outside every pass: the GPU waits while the host commits, plans and launches the next one.
"""
from __future__ import annotations

PARTS = ("draft", "copy_wait", "rebuild", "target", "host")
TARGET_PHASES = ("verify", "target")  # Specter's and SpecMoEOff's target pass; the peers' decode forward


def columns(parts: dict[str, float], tokens: int) -> dict[str, float]:
    """`parts` (ms over the decode span) as tpot_<part>_ms: per committed token after the first."""
    per = max(tokens - 1, 1)
    return {f"tpot_{name}_ms": parts[name] / per for name in PARTS}


def token_time(phases: dict[str, list[tuple[float, float]]], span: tuple[float, float],
               stalls: list[tuple[float, float, float]], rebuilds: list[tuple[float, float]], tokens: int) -> dict:
    """The tpot_* columns of one request. `phases`: name -> (begin, end) spans (DecodeMetrics.phase_spans_ms);
    `span`: (first commit, last commit); `stalls`: (start, copy wait, rebuild wait) of the compute stream's
    stalls; `rebuilds`: (start, end) of rebuilds on the compute stream; all in ms on one timeline. Only what
    starts inside `span` counts (the prefill's copies do not)."""
    start, end = span
    inside = lambda t: start <= t < end  # noqa: E731
    draft = sum(b - a for a, b in phases.get("draft", []) if inside(a))
    passes = sum(b - a for name in TARGET_PHASES for a, b in phases.get(name, []) if inside(a))
    copy_wait = sum(copy for at, copy, _ in stalls if inside(at))
    rebuild = sum(wait for at, _, wait in stalls if inside(at)) + sum(b - a for a, b in rebuilds if inside(a))
    parts = {"draft": draft, "copy_wait": copy_wait, "rebuild": rebuild,
             "target": max(passes - copy_wait - rebuild, 0.0), "host": max((end - start) - draft - passes, 0.0)}
    return columns(parts, tokens)


def request_token_time(metrics, streams=None) -> dict:
    """token_time of a request decoded with `metrics` (DecodeMetrics), its stalls and rebuilds read from
    `streams` (offload.streams.DeviceStreams; None: nothing offloaded). Empty before a second commit."""
    span = metrics.decode_span_ms()
    if span is None:
        return {}
    stalls, rebuilds = streams.critical_path_ms(metrics.timeline) if streams is not None else ([], [])
    return token_time(metrics.phase_spans_ms(), span, stalls, rebuilds, metrics.committed_tokens())
