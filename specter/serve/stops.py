"""`stop` strings: the text cut where the first one completes, streamed without ever sending a stop string."""
from __future__ import annotations

from collections.abc import Callable

from specter.text import decode_text


def first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, int] | None:
    """(start, end) of the stop string occurrence in `text` that completes first (then starts first); None."""
    found = []
    for stop in stops:
        start = text.find(stop)
        if start >= 0:
            found.append((start + len(stop), start))
    if not found:
        return None
    end, start = min(found)
    return start, end


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could begin a stop string (they wait for the next piece)."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class StopText:
    """Streams the pieces given to `feed` to `emit`, cut before the first stop string. Without stop strings every
    piece passes as it is; with them, text that may begin a stop string waits for the next piece (or `finish`)."""

    def __init__(self, stops: tuple[str, ...], emit: Callable[[str], object]) -> None:
        self.stops, self.emit = stops, emit
        self.text, self.sent = "", 0
        self.end: int | None = None  # where the stop string that cut the text ends

    @property
    def stopped(self) -> bool:
        return self.end is not None

    @property
    def result(self) -> str:
        return self.text[:self.sent]

    def feed(self, piece: str) -> None:
        if self.stopped:
            return
        self.text += piece
        hit = first_stop(self.text, self.stops)
        if hit is not None:
            start, self.end = hit
            self._send(start)
        else:
            self._send(len(self.text) - held_back(self.text, self.stops))

    def finish(self) -> None:
        """The text held back at the end goes out (it began no stop string)."""
        if not self.stopped:
            self._send(len(self.text))

    def _send(self, upto: int) -> None:
        if upto > self.sent:
            piece, self.sent = self.text[self.sent:upto], upto
            self.emit(piece)


def tokens_through(tokenizer, token_ids: list[int], chars: int, start: int = 0) -> int:
    """The fewest of `token_ids` (more than `start`) whose text reaches `chars` characters: the tokens a request
    used up to the end of its stop string."""
    for n in range(start + 1, len(token_ids) + 1):
        if len(decode_text(tokenizer, token_ids[:n])) >= chars:
            return n
    return len(token_ids)
