"""The speculative window loop, written once: per window, draft k tokens while the planner turns their routing
into prefetches, verify k + 1 positions with the window's plan, commit. Specter's single request and batch and
SpecMoEOff's single request and microbatches are each a `Decoding` that this loop drives on their system's
`Windows`."""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol


class Decoding(Protocol):
    """The requests being decoded (one, a batch, microbatches taking turns), as the window loop drives them."""

    def next_window(self) -> int | None: ...  # k of the next window; None: every request is done

    def draft(self, k: int) -> tuple[Any, Any]: ...  # (the window's drafts, its plan: speculative.window)

    def verify(self, drafts: Any) -> Any: ...  # the target pass over the drafts: what each request accepts

    def commit(self, k: int, verified: Any) -> Any: ...  # the accepted tokens committed; what the system counts


class Windows(Protocol):
    """A system's side of every window: its counts, and the residency manager its target pass reads through."""

    def begin_window(self) -> None: ...

    def verifying(self, plan: Any) -> AbstractContextManager: ...

    def close_window(self, plan: Any, committed: Any) -> None: ...


def decode_windows(decoding: Decoding, windows: Windows) -> int:
    """Run speculative windows until every request of `decoding` is done; the number of windows."""
    count = 0
    while (k := decoding.next_window()) is not None:
        windows.begin_window()
        drafts, plan = decoding.draft(k)
        with windows.verifying(plan):
            verified = decoding.verify(drafts)
        windows.close_window(plan, decoding.commit(k, verified))
        count += 1
    return count
