"""One worker thread owns the engines and runs the queued requests one job at a time, greedy ones batched together."""
from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specter.errors import SpecterError, first_line
from specter.serve.decode import Outcome, RequestText, decode_batch, decode_one
from specter.serve.protocol import ApiError, Request

HISTORY = 256  # finished jobs the scheduler remembers (stats and tests)


@dataclass(eq=False)
class Job:
    """A request waiting for the worker. `emit(kind, payload)` is called from the worker thread: ("piece", text)
    for each streamed piece, then ("done", Outcome) or ("error", ApiError)."""

    id: str
    request: Request
    emit: Callable[[str, object], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)

    @property
    def batchable(self) -> bool:
        """Greedy: it may decode in one batch with the others queued beside it."""
        return self.request.greedy

    def cancel(self) -> None:
        self.cancelled.set()

    def text(self, tokenizer) -> RequestText:
        """The request's text as it decodes, its pieces emitted when it streams."""
        emit = (lambda piece: self.emit("piece", piece)) if self.request.stream else (lambda piece: None)
        return RequestText(tokenizer, self.request.max_tokens, self.request.stop, emit, self.cancelled)


class Scheduler:
    """Runs jobs on `served`'s engines, one at a time, on one worker thread: a greedy job (streaming or not) takes
    with it every greedy job queued beside it (at most `max_batch`) into one
    `engine.generate([...])` batch, each streaming its own pieces; sampling jobs, and a greedy job with no company,
    decode alone (`python -m specter generate`'s path), in arrival order. A cancelled job is dropped from the
    queue, or ends at its next commit (in a batch, the others go on)."""

    def __init__(self, served, max_batch: int = 16,
                 log: logging.Logger | None = None) -> None:
        self.served, self.max_batch = served, max_batch
        self.log = log or logging.getLogger("specter.serve")
        self.pending: deque[Job] = deque()
        self.condition = threading.Condition()
        self.running: list[Job] = []
        self.counts: Counter = Counter(dict.fromkeys(("submitted", "completed", "cancelled", "failed"), 0))
        self.batch_sizes: Counter = Counter()
        self.history: deque[dict] = deque(maxlen=HISTORY)
        self.stopping = False
        self.thread = threading.Thread(target=self._work, name="specter-scheduler", daemon=True)

    def start(self) -> Scheduler:
        self.thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Take no more jobs; the queued ones get a 503, the running one finishes."""
        with self.condition:
            self.stopping = True
            dropped = list(self.pending)
            self.pending.clear()
            self.condition.notify_all()
        for job in dropped:
            job.emit("error", ApiError(503, "the server is shutting down", code="shutting_down", kind="server_error"))
        if self.thread.is_alive():
            self.thread.join(timeout)

    def submit(self, job: Job) -> None:
        with self.condition:
            if self.stopping:
                raise ApiError(503, "the server is shutting down", code="shutting_down", kind="server_error")
            self.pending.append(job)
            self.counts["submitted"] += 1
            self.condition.notify_all()

    def stats(self) -> dict:
        with self.condition:
            return {"queued": len(self.pending), "running": len(self.running), **dict(self.counts),
                    "batches": {str(size): n for size, n in sorted(self.batch_sizes.items())}}

    def _work(self) -> None:
        while True:
            jobs = self._next()
            if jobs is None:
                return
            try:
                if len(jobs) > 1:
                    self._run_batch(jobs)
                else:
                    self._run_one(jobs[0])
            finally:
                with self.condition:
                    self.running = []

    def _next(self) -> list[Job] | None:
        """The next job (a batchable one with the batchable jobs queued beside it), cancelled ones dropped."""
        with self.condition:
            while True:
                while self.pending and self.pending[0].cancelled.is_set():
                    self._finish(self.pending.popleft(), "cancelled", 0)
                if self.pending or self.stopping:
                    break
                self.condition.wait()
            if self.stopping:
                return None
            first = self.pending.popleft()
            jobs = [first] + (self._companions(first) if first.batchable else [])
            self.running = jobs
            return jobs

    def _companions(self, first: Job) -> list[Job]:
        """Queued batchable jobs that fit the context beside `first`, taken off the queue (at most max_batch)."""
        context = self.served.max_positions
        taken, longest_prompt, longest_new = [], len(first.request.prompt_ids), first.request.max_tokens
        for job in list(self.pending):
            if len(taken) + 1 >= self.max_batch:
                break
            if not job.batchable or job.cancelled.is_set():
                continue
            prompt, new = max(longest_prompt, len(job.request.prompt_ids)), max(longest_new, job.request.max_tokens)
            if context is not None and prompt + new > context:
                continue
            longest_prompt, longest_new = prompt, new
            self.pending.remove(job)
            taken.append(job)
        return taken

    def _run_one(self, job: Job) -> None:
        request = job.request
        seed = request.seed if request.seed is not None else random.randrange(2**31)  # unseeded: fresh draws
        try:
            engine = self.served.engine_for(request.temperature, request.top_p, seed)
            outcome = decode_one(engine, request.prompt_ids, job.text(self.served.tokenizer))
        except Exception as exc:  # noqa: BLE001 - one request's failure is its own: the worker goes on
            self._fail([job], exc)
            return
        self._done(job, outcome, 1)

    def _run_batch(self, jobs: list[Job]) -> None:
        live = [job for job in jobs if not job.cancelled.is_set()]
        for job in jobs:
            if job.cancelled.is_set():
                self._finish(job, "cancelled", 0)
        if len(live) <= 1:
            for job in live:
                self._run_one(job)
            return
        texts = [job.text(self.served.tokenizer) for job in live]
        try:
            engine = self.served.engine_for(0.0, 1.0, 0)
            outcomes = decode_batch(engine, [(job.request.prompt_ids, text) for job, text in zip(live, texts)])
        except Exception as exc:  # noqa: BLE001 - those that saw nothing yet are retried one by one below
            self.log.warning("a batch of %d failed (%s: %s); its requests decode one at a time", len(live),
                             type(exc).__name__, first_line(exc))
            for job, text in zip(live, texts):  # one request's bad input fails that request only
                if text.committed:
                    self._fail([job], exc)  # it has streamed text already: not decoded again
                else:
                    self._run_one(job)
            return
        with self.condition:
            self.batch_sizes[len(live)] += 1
        for job, outcome in zip(live, outcomes):
            self._done(job, outcome, len(live))

    def _done(self, job: Job, outcome: Outcome, batch: int) -> None:
        if outcome.finish_reason == "cancelled":
            self._finish(job, "cancelled", outcome.completion_tokens, batch)
            return
        self._finish(job, "completed", outcome.completion_tokens, batch)
        job.emit("done", outcome)

    def _fail(self, jobs: list[Job], exc: Exception) -> None:
        if isinstance(exc, SpecterError):
            error = ApiError(400, first_line(exc))
        else:
            self.log.debug("the decode failed", exc_info=exc)  # the route logs its one line
            error = ApiError(500, f"the decode failed: {type(exc).__name__}: {first_line(exc)}", kind="server_error")
        for job in jobs:
            self._finish(job, "failed", None)
            job.emit("error", error)

    def _finish(self, job: Job, status: str, completion_tokens: int | None, batch: int | None = None) -> None:
        with self.condition:
            self.counts[status] += 1
            self.history.append({"id": job.id, "status": status, "completion_tokens": completion_tokens,
                                 "batch": batch, "max_tokens": job.request.max_tokens,
                                 "seconds": time.perf_counter() - job.submitted})
