"""The draft phase of a speculative window, written once: k draft steps while the planner turns their routing into
prefetches, then the window's plan. Specter's single-request and batched loops and SpecMoEOff's (single and
microbatched) each plug in their draft step, routing observer and planner."""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol, TypeVar

Draft = TypeVar("Draft")  # what one draft step gives: a token [1], a batch's tokens [B, 1], (token, distribution)


class Planner(Protocol):
    """Turns the draft's routing into prefetches during the window (Specter's PrefetchPlanner, NoPrefetch,
    SpecMoEOff's FixedPositionPrefetch) and closes the window with its plan."""

    def begin_window(self, k: int) -> None: ...

    def after_draft_token(self, drafted: int) -> Any: ...  # called once draft step `drafted` is enqueued

    def end_window(self) -> Any: ...  # the window's plan


def draft_window(k: int, step: Callable[[int, Any], Draft], planner: Planner,
                 observing: Callable[[], AbstractContextManager],
                 planned: Callable[[int, Any], None] | None = None) -> tuple[list[Draft], Any]:
    """(the k drafts, the window's plan; None when k is 0). `step(i, previous)` makes draft i from the previous
    one (None at i = 0: the step starts from the committed tokens); its routing is reported inside `observing()`
    and the planner hears of each step once it is enqueued; `planned(n, result)` sees what the planner's
    `after_draft_token(n)` returned (SpecMoEOff times its steps by it)."""
    drafts: list[Draft] = []
    plan = None
    with observing() if k else nullcontext():
        planner.begin_window(k)
        for i in range(k):
            drafts.append(step(i, drafts[-1] if drafts else None))
            result = planner.after_draft_token(i + 1)
            if planned is not None:
                planned(i + 1, result)
        if k:
            plan = planner.end_window()
    return drafts, plan


def plan_drafted_window(planner: Planner, k: int) -> Any:
    """The plan of a window whose k drafts were made ahead (their routing already counted): the planner closes
    it at once, with no draft steps left to hide prefetches behind (None when k is 0)."""
    planner.begin_window(k)
    return planner.end_window() if k else None
