"""One expert's residuals as a single int32 blob (what a residual copy moves), with its torch reference decode.

An expert's linears (gate_up [2I, H], then down [H, I]) are encoded with `specter.quant.residual.encode`
against the draft's codes and concatenated into one blob of int32 words:

    [ word start of every group (int32, linear after linear, row-major)   total_groups words
    | class byte of every group (uint8, 4 per word, same order)           ceil(total_groups / 4) words
    | the linears' bit streams, one after the other                       the rest ]

A group's class byte holds its margin class (bits 0-2) and its zero width (bits 3-7); its word start counts
from the first stream word. Every expert of a model has the same header; only
the stream length differs, so one `BlobLayout` describes them all.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specter.quant.int4 import Int4Linear, unpack_codes
from specter.quant.residual import ResidualTensor, decode, encode, stream_as_int32

CLASSES_PER_WORD = 4
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

    @property
    def class_word(self) -> int:
        """The first word of the margin classes."""
        return self.total_groups

    @property
    def stream_word(self) -> int:
        """The first word of the bit streams."""
        return self.total_groups + math.ceil(self.total_groups / CLASSES_PER_WORD)

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


def encode_experts(weights: list[torch.Tensor], drafts: list[Int4Linear]) -> list[torch.Tensor]:
    """The blobs of n experts at once: their linears W [n, out, in] against their stacked drafts (one
    batched encode per linear, then each expert's slice of it)."""
    parts = [encode(w, unpack_codes(d.qweight), scales_by_row(d), d.group_size) for w, d in zip(weights, drafts)]
    firsts = [torch.cat([p.word_start[:, 0, 0], p.word_start.new_tensor([p.words.numel()])]).tolist()
              for p in parts]  # [n + 1] per linear: where each expert's stream starts
    return [expert_blob([ResidualTensor(p.margin_class[e], p.zero_width[e], p.word_start[e] - first[e],
                                        p.words[first[e]:first[e + 1]], p.dtype, p.group_size)
                         for p, first in zip(parts, firsts)])
            for e in range(weights[0].shape[0])]


def expert_blob(parts: list[ResidualTensor]) -> torch.Tensor:
    """One expert's linears, each with its own stream, as the blob of the module docstring."""
    starts, stream_words = [], 0
    for part in parts:
        starts.append(part.word_start.flatten() + stream_words)
        stream_words += part.words.numel()
    classes = torch.cat([(p.margin_class | (p.zero_width << ZERO_WIDTH_SHIFT)).flatten() for p in parts])
    classes = torch.cat([classes, classes.new_zeros(-classes.numel() % CLASSES_PER_WORD)])
    return torch.cat([torch.cat(starts).to(torch.int32), classes.view(torch.int32)]
                     + [stream_as_int32(p.words) for p in parts])


def split_blob(blob: torch.Tensor, layout: BlobLayout, dtype: torch.dtype) -> list[ResidualTensor]:
    """The blob's linears as `ResidualTensor`s (each with its own stream), the inverse of `encode_expert`."""
    blob = blob.cpu()
    words = blob[layout.stream_word:].to(torch.int64) & 0xFFFFFFFF
    classes = blob[layout.class_word:layout.stream_word].view(torch.uint8)
    parts = []
    for part, (out_features, in_features) in enumerate(layout.shapes):
        base, groups = layout.group_base(part), layout.groups(part)
        shape = (out_features, in_features // layout.group_size)
        start = blob[base:base + groups].to(torch.int64).view(shape)
        end = int(blob[base + groups]) if part + 1 < len(layout.shapes) else words.numel()
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
