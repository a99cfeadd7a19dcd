"""The speculative window loop, written once: per window, draft k tokens while the planner turns their routing
into prefetches, verify k + 1 positions through the window's target executor (its plan), commit. Specter's single
request and batch and SpecMoEOff's single request and microbatches are each a `Decoding` that this loop drives on
their call's `Windows`."""
from __future__ import annotations

from typing import Any, Protocol


class Decoding(Protocol):
    """The requests being decoded (one, a batch, microbatches taking turns), as the window loop drives them."""

    def next_window(self) -> int | None: ...  # k of the next window; None: every request is done

    def draft(self, k: int) -> tuple[Any, Any]: ...  # (the window's drafts, its plan: speculative.window)

    def verify(self, drafts: Any, executor: Any) -> Any: ...  # the target pass over the drafts (its routed
    # experts through `executor`): what each request accepts

    def commit(self, k: int, verified: Any) -> Any: ...  # the accepted tokens committed; what the system counts


class Windows(Protocol):
    """A system's side of every window: its counts, and the target executor of its target pass."""

    def begin_window(self) -> None: ...

    def verifier(self, plan: Any) -> Any: ...  # the window's target executor: its residency manager with `plan`

    def close_window(self, plan: Any, committed: Any) -> None: ...


def decode_windows(decoding: Decoding, windows: Windows) -> int:
    """Run speculative windows until every request of `decoding` is done; the number of windows."""
    count = 0
    while (k := decoding.next_window()) is not None:
        windows.begin_window()
        drafts, plan = decoding.draft(k)
        verified = decoding.verify(drafts, windows.verifier(plan))
        windows.close_window(plan, decoding.commit(k, verified))
        count += 1
    return count
