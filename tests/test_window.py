"""The window is written once: its draft phase (specter/speculative/window.py) and the loop of draft, verify and
commit (specter/speculative/loop.py); their call order, and no decode loop re-writes them."""
import re
from contextlib import contextmanager
from pathlib import Path

from specter.speculative.loop import decode_windows
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


class Requests:
    """A Decoding and its system's Windows at once, logging the loop's calls: windows of k = 3, 2, then done."""

    def __init__(self):
        self.calls, self.ks = [], [3, 2]

    def next_window(self):
        return self.ks.pop(0) if self.ks else None

    def draft(self, k):
        self.calls.append(("draft", k))
        return f"drafts{k}", f"plan{k}"

    def verifier(self, plan):
        self.calls.append(("verifier", plan))
        return f"executor-{plan}"

    def verify(self, drafts, executor):
        self.calls.append(("verify", drafts, executor))
        return f"accepted-{drafts}"

    def commit(self, k, verified):
        self.calls.append(("commit", k, verified))
        return f"window{k}"

    def begin_window(self):
        self.calls.append(("begin",))

    def close_window(self, plan, committed):
        self.calls.append(("close", plan, committed))


def test_the_window_loop_drafts_verifies_through_the_plans_executor_and_commits_until_done():
    log = Requests()
    assert decode_windows(log, log) == 2
    window = [("begin",), ("draft", 3), ("verifier", "plan3"), ("verify", "drafts3", "executor-plan3"),
              ("commit", 3, "accepted-drafts3"), ("close", "plan3", "window3")]
    assert log.calls == window + [(c[0], *(str(x).replace("3", "2") if not isinstance(x, int) else 2
                                             for x in c[1:])) for c in window]


def test_no_decode_loop_rewrites_the_window():
    """Only specter/speculative/loop.py asks a system for a window's target executor (`.verifier(`): no other
    decode path verifies a window's drafts with its plan. (The benchmarks of the host path drive the residency
    manager directly and are not decode loops.)"""
    calls = re.compile(r"\.verifier\(")
    found = [str(path.relative_to(ROOT)) for package in ("specter", "baselines", "experiments")
             for path in sorted((ROOT / package).rglob("*.py")) if calls.search(path.read_text())]
    assert found == ["specter/speculative/loop.py"], found


def test_no_shared_object_is_installed_on_the_decode_path():
    """The target's executor, a window's plan and the draft's workspace are passed to each forward
    (HybridMoEModel.forward's `executor` and `draft_workspace`), never installed by a system for its call: no
    `attributes_set` and no `verifying` context anywhere in the package, the baselines or the harness (the
    hooks module defines it; benchmarks that fake the device use it)."""
    installed = re.compile(r"attributes_set\(|def verifying\(|\.verifying\(")
    found = [str(path.relative_to(ROOT)) for package in ("specter", "baselines", "experiments")
             for path in sorted((ROOT / package).rglob("*.py")) if installed.search(path.read_text())]
    assert found == ["specter/hooks.py"], found
