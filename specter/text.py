"""Text in, text out: encode a prompt, decode it with an engine, detokenize the new tokens (streamed as they commit)."""
from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers

from specter.errors import SpecterError

REPLACEMENT = "\ufffd"  # what a decode gives for an incomplete UTF-8 sequence at the end of the tokens so far
UNSETTLED_END = re.compile(rf"[\s{REPLACEMENT}]+$")  # text a later token may still change: U+FFFD and whitespace
SHOWN_AS_IS = frozenset("\n\t\u200c\u200d")  # newline, tab and the joiners that emoji and some scripts need


@dataclass(frozen=True)
class TextResult:
    """A text generation: the new text, the new token ids it decodes (EOS included when it ended there), the stats."""

    text: str
    token_ids: list[int]
    stats: dict


def printable(text: str) -> str:
    """`text` safe for a terminal: every character Python does not count as printable (control characters such as
    the bell or an escape sequence's ESC, format and unassigned code points) as its escape, e.g. `\\x07`;
    newline, tab, the joiners and spaces are kept as they are."""
    return "".join(char if shown_as_is(char) else char.encode("unicode_escape").decode("ascii") for char in text)


def shown_as_is(char: str) -> bool:
    return char.isprintable() or char in SHOWN_AS_IS or unicodedata.category(char) == "Zs"


def check_request(prompt, max_new_tokens) -> None:
    """One-line errors for a prompt that is not a non-empty string and a max_new_tokens that is not an integer >= 1."""
    if not isinstance(prompt, str):
        raise SpecterError(f"the prompt must be a string, got {type(prompt).__name__}")
    if not prompt:
        raise SpecterError("the prompt is empty: give some text to continue")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise SpecterError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")


def encode_prompt(tokenizer, prompt: str, chat: bool = False) -> list[int]:
    """The prompt's token ids (the tokenizer's own special tokens added); with `chat` the text is one user turn of the
    tokenizer's chat template, followed by the assistant's generation prompt."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise SpecterError("chat needs a chat template and this model's tokenizer has none; "
                               "give the prompt as plain text (without chat)")
        templated = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                  add_generation_prompt=True)
        ids = tokenizer.encode(templated, add_special_tokens=False)  # the template writes its own BOS
    else:
        ids = tokenizer.encode(prompt)
    if not ids:
        raise SpecterError(f"the prompt {prompt[:40]!r} encodes to no tokens with this model's tokenizer")
    return list(ids)


def decode_text(tokenizer, token_ids: list[int]) -> str:
    """The text of `token_ids`: special tokens (BOS, EOS, chat markers) are left out."""
    if isinstance(tokenizer, transformers.PreTrainedTokenizerBase):
        return tokenizer.decode(token_ids, skip_special_tokens=True)
    return tokenizer.decode(token_ids)  # the ByteTokenizer drops its special ids itself


class StreamDecoder:
    """Incremental detokenization: call it with each batch of newly committed token ids, then `finish()`.

    Every call decodes all the tokens so far and passes `stream` only the text that is new. Text is held back
    while it ends in U+FFFD (a multi-byte character split across tokens) or in whitespace (a tokenizer's
    clean-up may still join it to the next token, as in " ." -> "."), and whenever it stops extending the text
    already streamed; `finish()` streams the rest. Tokens after `eos_token_id` are ignored, so the pieces
    concatenate to `decode_text` of the tokens up to and including EOS.
    """

    def __init__(self, tokenizer, stream: Callable[[str], object], eos_token_id: int | None = None) -> None:
        self.tokenizer, self.stream, self.eos = tokenizer, stream, eos_token_id
        self.token_ids: list[int] = []
        self.emitted = ""

    def __call__(self, new_token_ids) -> None:
        if self.eos is not None and self.eos in self.token_ids:
            return
        self.token_ids.extend(int(t) for t in new_token_ids)
        if self.eos is not None and self.eos in self.token_ids:
            del self.token_ids[self.token_ids.index(self.eos) + 1:]
        self._emit(UNSETTLED_END.sub("", decode_text(self.tokenizer, self.token_ids)))

    def finish(self, token_ids=None) -> str:
        """Stream whatever was held back (of `token_ids`, the final tokens, when given); returns the whole text."""
        if token_ids is not None:
            self.token_ids = [int(t) for t in token_ids]
        text = decode_text(self.tokenizer, self.token_ids)
        self._emit(text)
        return text

    def _emit(self, text: str) -> None:
        if len(text) > len(self.emitted) and text.startswith(self.emitted):
            piece, self.emitted = text[len(self.emitted):], text
            self.stream(piece)


def stream_decoder(tokenizer, stream: Callable[[str], object], eos_token_id: int | None = None) -> StreamDecoder:
    """A `push(new_token_ids)` callable that streams the new text of each commit to `stream` (see StreamDecoder)."""
    return StreamDecoder(tokenizer, stream, eos_token_id)


def generate_text(engine, prompt: str, max_new_tokens: int = 128, *, chat: bool = False,
                  stream: Callable[[str], object] | None = None, eos: bool = True) -> TextResult:
    """Continue `prompt` (with `chat`: answer it as a user turn of the tokenizer's chat template) for at most
    `max_new_tokens` tokens, stopping at the tokenizer's EOS when `eos` and it has one.

    stream: called with each new piece of text as tokens commit (`engine.generate`'s `on_commit`); the pieces
    concatenate to the result's text."""
    check_request(prompt, max_new_tokens)
    tokenizer = engine.model.tokenizer
    input_ids = torch.tensor([encode_prompt(tokenizer, prompt, chat)])
    eos_id = getattr(tokenizer, "eos_token_id", None) if eos else None
    push = stream_decoder(tokenizer, stream, eos_id) if stream is not None else None
    out = engine.generate(input_ids, max_new_tokens, eos_token_id=eos_id, on_commit=push)
    token_ids = [int(t) for t in out.token_ids]
    text = decode_text(tokenizer, token_ids) if push is None else push.finish(token_ids)
    return TextResult(text, token_ids, dict(out.stats))
