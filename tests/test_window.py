"""The draft phase of a window is written once (specter/speculative/window.py): its call order, and no other
decode loop re-writes it."""
import re
from contextlib import contextmanager
from pathlib import Path

from specter.speculative.window import draft_window, plan_drafted_window

ROOT = Path(__file__).resolve().parent.parent


class Recorder:
    """A planner and routing observer that log the calls they get."""

    def __init__(self):
        self.calls = []

    def begin_window(self, k):
        self.calls.append(("begin", k))

    def after_draft_token(self, drafted):
        self.calls.append(("after", drafted))
        return drafted == 2

    def end_window(self):
        self.calls.append(("end",))
        return "plan"

    @contextmanager
    def observing(self):
        self.calls.append(("observe",))
        yield
        self.calls.append(("observed",))


def test_the_draft_steps_chain_and_the_planner_hears_each_inside_the_observer():
    log = Recorder()

    def step(i, previous):
        log.calls.append(("step", i, previous))
        return 10 * (i + 1)

    read = []
    drafts, plan = draft_window(3, step, log, log.observing, lambda n, result: read.append((n, result)))
    assert drafts == [10, 20, 30] and plan == "plan"
    assert log.calls == [("observe",), ("begin", 3), ("step", 0, None), ("after", 1), ("step", 1, 10), ("after", 2),
                         ("step", 2, 20), ("after", 3), ("end",), ("observed",)]
    assert read == [(1, False), (2, True), (3, False)]


def test_an_empty_window_opens_no_observer_and_has_no_plan():
    log = Recorder()
    assert draft_window(0, lambda i, p: 1 / 0, log, log.observing) == ([], None)
    assert log.calls == [("begin", 0)]
    assert plan_drafted_window(log, 4) == "plan" and plan_drafted_window(log, 0) is None


def test_no_decode_loop_rewrites_the_draft_phase():
    """Only specter/speculative/window.py calls a planner's after_draft_token / end_window (grep-able)."""
    calls = re.compile(r"\.(after_draft_token|end_window)\(")
    found = [str(path.relative_to(ROOT)) for package in ("specter", "baselines", "benchmarks", "experiments")
             for path in sorted((ROOT / package).rglob("*.py")) if calls.search(path.read_text())]
    assert found == ["specter/speculative/window.py"]
