"""Byte-level tokenizer for synthetic models: token id = UTF-8 byte value, plus BOS/EOS/PAD."""
from __future__ import annotations

import torch


class ByteTokenizer:
    """Encodes text as its UTF-8 bytes (ids 0-255); 256/257/258 are BOS/EOS/PAD.

    Synthetic models have random weights, so their tokens carry no meaning; this tokenizer only
    gives the harness real prompts of a known length. Ids >= 259 (the vocabulary is padded to 320)
    are never produced by encode and are skipped by decode.
    """

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258

    def __init__(self, vocab_size: int = 320) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def __call__(self, text: str, return_tensors: str | None = None) -> dict:
        ids = self.encode(text)
        return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}
