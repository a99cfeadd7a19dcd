"""One expert's residuals as a single int32 blob (what a residual copy moves), with its torch reference decode.

An expert's linears (gate_up [2I, H], then down [H, I]) are encoded with `specter.quant.residual.encode`
against the draft's codes and concatenated into one blob of int32 words:

    [ word start of every output row (int32, linear after linear)        total_rows words
    | word count of every group (uint8, 4 per word, row-major)            ceil(total_groups / 4) words
    | class byte of every group (uint8, 4 per word, same order)           ceil(total_groups / 4) words
    | the linears' bit streams, one after the other                       the rest ]

A group's stream starts at its row's word start plus the word counts of the row's groups before it, counted
from the first stream word (a group takes at most group_size / 2 words: a byte holds its count). Its class
byte holds its margin class (bits 0-2) and its zero width (bits 3-7). Every expert of a model has the same
header; only the stream length differs, so one `BlobLayout` describes them all.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specter.quant.int4 import Int4Linear, unpack_codes
from specter.quant.residual import ResidualTensor, decode, encode, stream_as_int32

BYTES_PER_WORD = 4
ZERO_WIDTH_SHIFT = 3  # a class byte: margin class in bits 0-2, zero width above


@dataclass(frozen=True)
class BlobLayout:
    """Shapes (out, in) of an expert's linears, in blob order, and the group size of their draft codes."""

    shapes: tuple[tuple[int, int], ...]
    group_size: int

    def groups(self, part: int) -> int:
        out_features, in_features = self.shapes[part]
        return out_features * in_features // self.group_size

    def group_base(self, part: int) -> int:
        """Index of the part's first group among all the expert's groups."""
        return sum(self.groups(p) for p in range(part))

    @property
    def total_groups(self) -> int:
        return self.group_base(len(self.shapes))

    def row_base(self, part: int) -> int:
        """Index of the part's first output row among all the expert's rows (the word of its start)."""
        return sum(out_features for out_features, _ in self.shapes[:part])

    @property
    def count_word(self) -> int:
        """The first word of the groups' word counts."""
        return self.row_base(len(self.shapes))

    @property
    def class_word(self) -> int:
        """The first word of the margin classes."""
        return self.count_word + math.ceil(self.total_groups / BYTES_PER_WORD)

    @property
    def stream_word(self) -> int:
        """The first word of the bit streams."""
        return self.class_word + math.ceil(self.total_groups / BYTES_PER_WORD)

    def output_base(self, part: int) -> int:
        """Element offset of the part's weights in the expert's flat buffer (gate_up, then down)."""
        return sum(o * i for o, i in self.shapes[:part])


def expert_layout(hidden: int, intermediate: int, group_size: int) -> BlobLayout:
    return BlobLayout(((2 * intermediate, hidden), (hidden, intermediate)), group_size)


def scales_by_row(draft: Int4Linear) -> torch.Tensor:
    """The draft's scales [in/g, out] as the reference reads them: [out, in/g]."""
    return draft.scales.transpose(-1, -2)


def encode_expert(weights: list[torch.Tensor], drafts: list[Int4Linear]) -> torch.Tensor:
    """The blob (int32 [n], on the weights' device) of one expert's linears W [out, in] against their drafts."""
    return encode_experts([w.unsqueeze(0) for w in weights],
                          [Int4Linear(d.qweight.unsqueeze(0), d.scales.unsqueeze(0), d.group_size) for d in drafts])[0]


def encode_experts(weights: list[torch.Tensor], drafts: list[Int4Linear],
                   max_weights: int | None = None) -> list[torch.Tensor]:
    """The blobs of n experts at once: their linears W [n, out, in] against their stacked drafts (one
    batched encode per linear, then each expert's slice of it). With `max_weights`, a single expert's linear
    larger than that is encoded a slice of rows at a time (`encode_in_rows`)."""
    parts = [encode_in_rows(w, d, max_weights) for w, d in zip(weights, drafts)]
    firsts = [torch.cat([p.word_start[:, 0, 0], p.word_start.new_tensor([p.words.numel()])]).tolist()
              for p in parts]  # [n + 1] per linear: where each expert's stream starts
    return [expert_blob([ResidualTensor(p.margin_class[e], p.zero_width[e], p.word_start[e] - first[e],
                                        p.words[first[e]:first[e + 1]], p.dtype, p.group_size)
                         for p, first in zip(parts, firsts)])
            for e in range(weights[0].shape[0])]


def encode_in_rows(weight: torch.Tensor, draft: Int4Linear, max_weights: int | None = None) -> ResidualTensor:
    """`encode` of W [n, out, in] against its draft, in slices of output rows of at most `max_weights` weights
    (None: at once; the draft's codes are unpacked a slice at a time too), joined into the one encoding: every
    group starts on a word of its own, so a slice's word starts move by the words before it. Slicing needs n = 1
    (the stream is expert-major)."""
    n, out_features, in_features = weight.shape
    rows = out_features if max_weights is None else max(1, max_weights // (n * in_features))
    if rows >= out_features:
        return encode(weight, unpack_codes(draft.qweight), scales_by_row(draft), draft.group_size)
    if n != 1:
        raise ValueError(f"slicing rows needs one expert per encode, got {n}")
    parts, words = [], 0
    for first in range(0, out_features, rows):
        rows_of = slice(first, first + rows)
        codes = unpack_codes(draft.qweight[..., rows_of])  # qweight [n, in/8, out]: a slice of output rows
        scales = draft.scales[..., rows_of].transpose(-1, -2)  # [n, rows, in/g]
        part = encode(weight[:, rows_of], codes, scales, draft.group_size)
        parts.append((part, words))
        words += part.words.numel()
    joined = lambda field: torch.cat([getattr(p, field) for p, _ in parts], dim=-2)  # noqa: E731
    return ResidualTensor(joined("margin_class"), joined("zero_width"),
                          torch.cat([p.word_start + before for p, before in parts], dim=-2),
                          torch.cat([p.words for p, _ in parts]), weight.dtype, draft.group_size)


def expert_blob(parts: list[ResidualTensor]) -> torch.Tensor:
    """One expert's linears, each with its own stream, as the blob of the module docstring."""
    row_starts, counts, stream_words = [], [], 0
    for part in parts:
        start = part.word_start + stream_words  # [out, in/g]
        end = torch.cat([start.flatten()[1:], start.new_tensor([stream_words + part.words.numel()])])
        row_starts.append(start[:, 0])
        counts.append(end - start.flatten())  # [out * in/g] words of each group
        stream_words += part.words.numel()
    counts = torch.cat(counts)
    if counts.numel() and int(counts.max()) > 255:
        raise ValueError(f"a group of {int(counts.max())} words does not fit the blob's count byte")
    classes = torch.cat([(p.margin_class | (p.zero_width << ZERO_WIDTH_SHIFT)).flatten() for p in parts])
    return torch.cat([torch.cat(row_starts).to(torch.int32), as_words(counts.to(torch.uint8)), as_words(classes)]
                     + [stream_as_int32(p.words) for p in parts])


def as_words(values: torch.Tensor) -> torch.Tensor:
    """uint8 values [n] as int32 words, zero-padded to whole words."""
    return torch.cat([values, values.new_zeros(-values.numel() % BYTES_PER_WORD)]).view(torch.int32)


def split_blob(blob: torch.Tensor, layout: BlobLayout, dtype: torch.dtype) -> list[ResidualTensor]:
    """The blob's linears as `ResidualTensor`s (each with its own stream), the inverse of `encode_expert`."""
    blob = blob.cpu()
    words = blob[layout.stream_word:].to(torch.int64) & 0xFFFFFFFF
    counts = blob[layout.count_word:layout.class_word].view(torch.uint8).to(torch.int64)
    classes = blob[layout.class_word:layout.stream_word].view(torch.uint8)
    parts = []
    for part, (out_features, in_features) in enumerate(layout.shapes):
        base, groups, row = layout.group_base(part), layout.groups(part), layout.row_base(part)
        shape = (out_features, in_features // layout.group_size)
        count = counts[base:base + groups].view(shape)
        start = blob[row:row + out_features].to(torch.int64).unsqueeze(-1) + torch.cumsum(count, -1) - count
        end = int(blob[row + out_features]) if part + 1 < len(layout.shapes) else words.numel()
        first = int(start.flatten()[0]) if groups else 0
        class_bytes = classes[base:base + groups].view(shape)
        parts.append(ResidualTensor(class_bytes & ((1 << ZERO_WIDTH_SHIFT) - 1), class_bytes >> ZERO_WIDTH_SHIFT,
                                    start - first, words[first:end].clone(), dtype, layout.group_size))
    return parts


def decode_expert_reference(blob: torch.Tensor, layout: BlobLayout, drafts: list[Int4Linear],
                            dtype: torch.dtype) -> torch.Tensor:
    """The expert's flat 16-bit weights [sum(out * in)] (gate_up, then down) from its blob, in plain torch."""
    parts = split_blob(blob, layout, dtype)
    rebuilt = [decode(p, unpack_codes(d.qweight.cpu()), scales_by_row(d).cpu()) for p, d in zip(parts, drafts)]
    return torch.cat([w.flatten() for w in rebuilt])
