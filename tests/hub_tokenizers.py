"""The tokenizer files of the tiny Hub-layout checkpoints (`tests/hub_checkpoints.py`), trained offline on CORPUS.

A real BPE tokenizer in each family's own format: byte-level BPE (DeepSeek, Qwen: GPT-2 style, Qwen's split
regex) or SentencePiece-style BPE with byte fallback and ▁ (Mixtral, Phi), with the special tokens at the real
positions and the real tokenizer_config.json class names; `break_tokenizer` removes them for the error tests.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

CORPUS = """\
The old lighthouse stood at the end of a long stone pier, and every evening the keeper climbed the narrow stairs to
light the lamp. From the top he could see the whole harbour: the fishing boats coming home, the gulls circling over
the nets, and the small houses of the town climbing up the hill behind the market. He had kept the light for thirty
years, and in all that time the ships had never once missed the entrance to the bay.

Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did
Natalia sell altogether in April and May? She counted them twice, wrote the numbers in her notebook, and found that
the answer was 72. Her brother said that the method mattered more than the answer, so she explained every step.

A train leaves the station at nine in the morning and travels north at sixty miles an hour. Another train leaves
two hours later on the same line and travels at ninety miles an hour. The question is when the second train will
catch up with the first, and how far from the station the two trains will be when it does.

In the garden there were apples, pears and plums, and the children picked the fruit in baskets while their
grandmother made jam in the kitchen. The jars were lined up on the window, red and gold in the afternoon light, and
the whole house smelled of sugar and warm fruit until the evening came and the lamps were lit.

def fibonacci(n):
    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)

The weather report said that the wind would turn to the west during the night, bringing rain and cooler air to the
coast. Farmers in the valley hoped the rain would come early, because the fields were dry and the river was low.
"""

# --- tokenizers -------------------------------------------------------------------------------------------

QWEN_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
              r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")  # Qwen2Tokenizer's PRETOKENIZE_REGEX
DSV2_BOS, DSV2_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
# (regular vocabulary size trained on CORPUS, special tokens appended after it, total padded to in config.json)
TOKENIZER_LAYOUT = {
    # DeepSeek-V2-Lite: 100000 regular tokens, then bos 100000, eos 100001, fim/chat tokens; config vocab 102400
    "dsv2": (480, [DSV2_BOS, DSV2_EOS, "<｜fim▁hole｜>", "<｜fim▁begin｜>", "<｜fim▁end｜>", "<|EOT|>"],
             512),
    # Qwen1.5: 151643 regular tokens, then <|endoftext|> (bos = eos = pad), <|im_start|>, <|im_end|>; config 151936
    "qwen": (480, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], 512),
    # Phi-3.5-MoE: <unk> <s> </s>, bytes, 32000 regular tokens total, then <|endoftext|> (eos) 32000 and the chat
    # tokens 32001-32010; config vocab 32064
    "phi": (480, ["<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
                  "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>"],
            512),
    # Mixtral: <unk> <s> </s>, bytes, 32000 tokens in all; config vocab 32000 (no padding)
    "mixtral": (512, [], 512),
}
LLAMA_STYLE = ("phi", "mixtral")


def _trained_merges(tokenizer) -> list[tuple[str, str]]:
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]


@functools.lru_cache(maxsize=None)
def _tokenizer_json(arch: str) -> str:
    """The arch's tokenizer.json (a string), trained on CORPUS; deterministic."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    regular, specials, _ = TOKENIZER_LAYOUT[arch]
    if arch in LLAMA_STYLE:
        # SentencePiece-style BPE as the Llama-family tokenizer.json has it: <unk> <s> </s>, <0x00>..<0xFF>
        # (byte fallback), then pieces with ▁ for spaces; normalizer Prepend(▁) + Replace(" ", ▁), no
        # pre-tokenizer
        trainer_tok = Tokenizer(models.BPE())
        trainer_tok.normalizer = normalizers.Replace(" ", "▁")
        trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
        trainer_tok.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=regular - 259, show_progress=False))
        pieces = sorted(trainer_tok.get_vocab().items(), key=lambda kv: kv[1])
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
        for piece, _ in pieces:
            vocab.setdefault(piece, len(vocab))
        tok = Tokenizer(models.BPE(vocab=vocab, merges=_trained_merges(trainer_tok), unk_token="<unk>",
                                   fuse_unk=True, byte_fallback=True))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.pre_tokenizer = None
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        tok.add_special_tokens(["<unk>", "<s>", "</s>"])
        if arch == "mixtral":  # add_bos_token true
            tok.post_processor = processors.TemplateProcessing(
                single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    else:
        tok = Tokenizer(models.BPE())
        if arch == "qwen":
            tok.normalizer = normalizers.NFC()
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=regular, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train_from_iterator([CORPUS], trainer)
        if arch == "qwen":
            tok.post_processor = processors.ByteLevel(trim_offsets=False)
    assert tok.get_vocab_size() == regular, (arch, tok.get_vocab_size())
    if specials:
        tok.add_special_tokens(specials)
    if arch == "dsv2":  # LlamaTokenizerFast with add_bos_token true: bos in the post-processor
        bos = tok.token_to_id(DSV2_BOS)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{DSV2_BOS} $A", pair=f"{DSV2_BOS} $A {DSV2_BOS} $B", special_tokens=[(DSV2_BOS, bos)])
    return tok.to_str(pretty=True)


def special_ids(arch: str) -> dict[str, int | None]:
    """bos / eos / pad ids of the tiny checkpoint (at the real positions relative to the vocabulary)."""
    regular, _, _ = TOKENIZER_LAYOUT[arch]
    if arch == "dsv2":
        return {"bos": regular, "eos": regular + 1, "pad": regular + 1}
    if arch == "qwen":
        return {"bos": regular, "eos": regular, "pad": regular}
    if arch == "phi":
        return {"bos": 1, "eos": regular, "pad": regular}
    return {"bos": 1, "eos": 2, "pad": None}


def _added_token(content: str) -> dict:
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": True, "rstrip": False,
            "single_word": False}


def _tokenizer_config(arch: str) -> tuple[dict, dict]:
    """(tokenizer_config.json, special_tokens_map.json) with the real repository's fields."""
    regular, specials, _ = TOKENIZER_LAYOUT[arch]
    decoder = {}
    if arch in LLAMA_STYLE:
        decoder.update({str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                                 "single_word": False, "special": True}
                        for i, c in enumerate(("<unk>", "<s>", "</s>"))})
    for i, c in enumerate(specials):
        decoder[str(regular + i)] = {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                                     "single_word": False, "special": True}
    if arch == "dsv2":
        config = {"add_bos_token": True, "add_eos_token": False, "bos_token": _added_token(DSV2_BOS),
                  "clean_up_tokenization_spaces": False, "eos_token": _added_token(DSV2_EOS), "legacy": True,
                  "model_max_length": 16384, "pad_token": _added_token(DSV2_EOS), "sp_model_kwargs": {},
                  "unk_token": None, "tokenizer_class": "LlamaTokenizerFast", "added_tokens_decoder": decoder}
        special_map = {"bos_token": DSV2_BOS, "eos_token": DSV2_EOS, "pad_token": DSV2_EOS}
    elif arch == "qwen":
        config = {"add_prefix_space": False, "added_tokens_decoder": decoder,
                  "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
                  "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>", "errors": "replace",
                  "model_max_length": 32768, "pad_token": "<|endoftext|>", "split_special_tokens": False,
                  "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}
        special_map = {"additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "eos_token": "<|endoftext|>",
                       "pad_token": "<|endoftext|>"}
    elif arch == "phi":
        config = {"add_bos_token": False, "add_eos_token": False, "added_tokens_decoder": decoder,
                  "bos_token": "<s>", "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>",
                  "legacy": False, "model_max_length": 131072, "pad_token": "<|endoftext|>", "padding_side": "left",
                  "sp_model_kwargs": {}, "tokenizer_class": "LlamaTokenizer", "unk_token": "<unk>",
                  "use_default_system_prompt": False}
        special_map = {"bos_token": "<s>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                       "unk_token": "<unk>"}
    else:
        config = {"add_bos_token": True, "add_eos_token": False, "added_tokens_decoder": decoder,
                  "additional_special_tokens": [], "bos_token": "<s>", "clean_up_tokenization_spaces": False,
                  "eos_token": "</s>", "legacy": True, "model_max_length": 1000000000000000019884624838656,
                  "pad_token": None, "sp_model_kwargs": {}, "spaces_between_special_tokens": False,
                  "tokenizer_class": "LlamaTokenizer", "unk_token": "<unk>", "use_default_system_prompt": False}
        special_map = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    return config, special_map


def tokenizer_files(arch: str) -> tuple[str, ...]:
    files = ("tokenizer.json", "tokenizer_config.json")
    return files + (("special_tokens_map.json",) if arch in LLAMA_STYLE else ())


def write_tokenizer(arch: str, directory: Path) -> None:
    directory = Path(directory)
    (directory / "tokenizer.json").write_text(_tokenizer_json(arch), encoding="utf-8")
    config, special_map = _tokenizer_config(arch)
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                     encoding="utf-8")
    if arch in LLAMA_STYLE:  # the Llama-family repos have special_tokens_map.json, DeepSeek and Qwen do not
        (directory / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2, ensure_ascii=False)
                                                           + "\n", encoding="utf-8")


def raw_tokenizer(arch: str):
    """The trained `tokenizers.Tokenizer` itself (what tokenizer.json holds)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_tokenizer_json(arch))


def break_tokenizer(directory: Path) -> list[Path]:
    """Remove every tokenizer file (tokenizer.json, tokenizer_config.json, special_tokens_map.json, vocab files)."""
    removed = []
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                 "vocab.json", "merges.txt"):
        path = Path(directory) / name
        if path.exists():
            path.unlink()
            removed.append(path)
    return removed
