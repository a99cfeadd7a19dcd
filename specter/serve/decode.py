"""Decoding on an engine: one request, or greedy requests as one batch, each request's text streamed as its
tokens commit."""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specter.serve.stops import StopText, tokens_through
from specter.text import stream_decoder


@dataclass(frozen=True)
class Outcome:
    """A finished request: its text, the tokens it used and why it ended ("stop": EOS or a stop string;
    "length": max_tokens; "cancelled": its client went away)."""

    text: str
    completion_tokens: int
    finish_reason: str


class RequestText:
    """One request's text as its tokens commit: the pieces `python -m specter generate` prints go to `emit`, cut
    before a stop string; `commit` says whether the request goes on (not past `max_tokens`, no stop string
    completed, its client still there)."""

    def __init__(self, tokenizer, max_tokens: int, stops: tuple[str, ...], emit: Callable[[str], object],
                 cancelled: threading.Event) -> None:
        self.tokenizer, self.max_tokens, self.cancelled = tokenizer, max_tokens, cancelled
        self.eos = getattr(tokenizer, "eos_token_id", None)
        self.text = StopText(stops, emit)
        self.push = stream_decoder(tokenizer, self.text.feed, self.eos)
        self.committed: list[int] = []
        self.stop_start: int | None = None  # committed tokens before the commit that completed a stop string

    @property
    def cut_short(self) -> bool:
        """A stop string completed, or the client went away."""
        return self.stop_start is not None or self.cancelled.is_set()

    @property
    def ended(self) -> bool:
        return self.cut_short or len(self.committed) >= self.max_tokens

    def commit(self, tokens) -> bool:
        """Take the request's newly committed tokens (those past `max_tokens` dropped); False once it has ended."""
        if self.ended:
            return False
        start = len(self.committed)
        new = [int(t) for t in tokens][:self.max_tokens - start]
        self.committed.extend(new)
        self.push(new)
        if self.text.stopped:
            self.stop_start = start
        return not self.ended

    def outcome(self, token_ids: list[int]) -> Outcome:
        """The request's outcome once the engine has returned its tokens (cut at EOS)."""
        if self.cancelled.is_set():
            return Outcome(self.text.result, len(self.committed), "cancelled")
        if self.stop_start is not None:
            return Outcome(self.text.result, self.used_through_stop(self.committed, self.stop_start), "stop")
        token_ids = token_ids[:self.max_tokens]
        self.push.finish(token_ids)
        self.text.finish()
        if self.text.stopped:  # the stop string completed in the text held back to the end
            return Outcome(self.text.result, self.used_through_stop(token_ids, 0), "stop")
        reason = "stop" if self.eos is not None and self.eos in token_ids else "length"
        return Outcome(self.text.result, len(token_ids), reason)

    def used_through_stop(self, token_ids: list[int], start: int) -> int:
        return tokens_through(self.tokenizer, token_ids, self.text.end, start)


class _Ended(Exception):
    """A single request's decode ends at this commit (a stop string completed, or its client went away)."""


def decode_one(engine, prompt_ids: list[int], text: RequestText) -> Outcome:
    """Decode one request through `engine.generate` with an `on_commit` (`python -m specter generate`'s path),
    ending at the first commit after which `text` says the request is done."""

    def on_commit(tokens) -> None:
        text.commit(tokens)
        if text.cut_short:
            raise _Ended

    try:
        out = engine.generate(torch.tensor([prompt_ids]), text.max_tokens, eos_token_id=text.eos, on_commit=on_commit)
    except _Ended:
        return text.outcome(text.committed)
    return text.outcome([int(t) for t in out.token_ids])


def decode_batch(engine, requests: list[tuple[list[int], RequestText]]) -> list[Outcome]:
    """Greedy requests (prompt ids, text) decoded together in one `engine.generate` batch, to the largest
    max_tokens; a request's commits stop reaching it once it has ended (it rides along)."""
    texts = [text for _, text in requests]
    longest = max(text.max_tokens for text in texts)
    results = engine.generate([prompt for prompt, _ in requests], longest, eos_token_id=texts[0].eos,
                              on_commit=lambda request, tokens: texts[request].commit(tokens))
    return [text.outcome([int(t) for t in result.token_ids]) for text, result in zip(texts, results)]
