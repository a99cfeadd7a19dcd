"""HF checkpoint -> GGUF with llama.cpp's own converter, taken from the llama-cpp-python source distribution."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch

from specter.errors import SpecterError
from specter.models.hybrid import HybridMoEModel

LLAMACPP_VERSION = "0.3.36"  # the pinned `llamacpp` extra; the converter must come from the same release
_VENDOR = f"llama_cpp_python-{LLAMACPP_VERSION}/vendor/llama.cpp"
_KEEP = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")  # all the converter needs from the 76 MB sdist
SETUP_HINT = "run scripts/setup_llamacpp.sh (or python -m baselines.gguf_convert --fetch)"
# HF class names the converter registers where transformers 5 saves another spelling
CONVERTER_ARCH = {"phimoe": "PhiMoEForCausalLM"}
SPECIAL_TOKENS = {"bos_token_id": "<s>", "eos_token_id": "</s>", "pad_token_id": "<pad>"}


def source_dir() -> Path:
    """Where the unpacked sdist lives: $SPECTER_LLAMACPP_SRC, else ~/.cache/specter/llama-cpp-src."""
    default = Path.home() / ".cache" / "specter" / "llama-cpp-src"
    return Path(os.environ.get("SPECTER_LLAMACPP_SRC") or default)


def converter_root() -> Path | None:
    """The vendored llama.cpp directory holding convert_hf_to_gguf.py, or None if not fetched yet."""
    root = source_dir() / _VENDOR
    return root if (root / "convert_hf_to_gguf.py").is_file() and (root / "gguf-py").is_dir() else None


def fetch_source() -> Path:
    """Unpack only the converter and its gguf-py from the sdist (downloaded with pip, no build); idempotent.

    $SPECTER_LLAMACPP_SDIST names a local sdist instead (machines without a package index).
    """
    if (root := converter_root()) is not None:
        return root
    with tempfile.TemporaryDirectory() as tmp:
        prefix = _VENDOR + "/"
        with tarfile.open(os.environ.get("SPECTER_LLAMACPP_SDIST") or _download_sdist(Path(tmp))) as tar:
            members = [m for m in tar.getmembers()
                       if m.name.startswith(prefix) and m.name[len(prefix):].startswith(_KEEP)]
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python >= 3.10.12
            tar.extractall(source_dir(), members=members, **safe)  # members filtered above
    if (root := converter_root()) is None:
        raise SpecterError(f"the llama-cpp-python {LLAMACPP_VERSION} sdist has no {_VENDOR}/convert_hf_to_gguf.py")
    return root


def _download_sdist(directory: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           f"llama-cpp-python=={LLAMACPP_VERSION}", "-d", str(directory)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    sdists = list(directory.glob("llama_cpp_python-*.tar.gz"))
    if done.returncode != 0 or not sdists:
        raise SpecterError(f"could not download the llama-cpp-python sdist: {done.stderr.strip()[-300:]}")
    return sdists[0]


def unconvertible(config) -> str | None:
    """Why llama.cpp cannot take this architecture as configured, or None if it can."""
    if config.model_type == "deepseek_v2" and not getattr(config, "q_lora_rank", None) \
            and config.num_hidden_layers not in (26, 27):
        return (f"llama.cpp reads a DeepSeek-V2 without q_lora_rank as V2-Lite only when it has 26-27 layers "
                f"(this one has {config.num_hidden_layers}); it then looks for the q_a/q_b tensors and fails")
    if config.model_type not in ("deepseek_v2", "qwen2_moe", "phimoe", "mixtral"):
        return f"no GGUF conversion path for model_type {config.model_type!r}"
    return None


def gguf_outtype(config, dtype: torch.dtype, device: torch.device) -> str:
    """GGUF weight type matching the model's dtype (DeepSeek-V2 runs in llama.cpp on the CPU only as f32)."""
    if dtype == torch.float32 or (config.model_type == "deepseek_v2" and device.type == "cpu"):
        return "f32"
    return "bf16" if dtype == torch.bfloat16 else "f16"


def _byte_level_chars() -> list[str]:
    """GPT-2's byte -> printable character table (byte-level BPE token strings)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b], extra = chr(256 + extra), extra + 1
    return [table[b] for b in range(256)]


def write_byte_tokenizer(directory: Path, vocab_size: int, tokenizer) -> None:
    """A byte-level BPE tokenizer whose ids are Specter's ByteTokenizer ids (id = byte, then BOS/EOS/PAD).

    Ids past the special tokens stay unnamed (the converter writes them as [PADn]); one merge into the
    first free id exists because llama.cpp refuses a BPE vocabulary without merges.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = _byte_level_chars()
    specials = {name: getattr(tokenizer, attr) for attr, name in SPECIAL_TOKENS.items()}
    vocab = {**{c: i for i, c in enumerate(chars)}, **specials}
    merge = (chars[ord(" ")], chars[ord("t")])
    vocab["".join(merge)] = free = max(vocab.values()) + 1
    if len(set(vocab.values())) != len(vocab) or free >= vocab_size:
        raise SpecterError(f"cannot name a byte-level vocabulary of {vocab_size} ids with specials {specials}")
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[merge]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens(list(specials))
    roles = {attr.removesuffix("_id"): name for attr, name in SPECIAL_TOKENS.items()}
    PreTrainedTokenizerFast(tokenizer_object=bpe, **roles).save_pretrained(directory)
    cfg_path = directory / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2))


def _fix_config(directory: Path, config) -> None:
    """Config spellings the converter expects (class names; PhiMoE's original context length)."""
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    if config.model_type in CONVERTER_ARCH:
        cfg["architectures"] = [CONVERTER_ARCH[config.model_type]]
    if config.model_type == "phimoe":  # no long-context scaling: original length = max length, factor 1
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope.setdefault("original_max_position_embeddings", cfg["max_position_embeddings"])
        cfg["rope_parameters"] = rope
    path.write_text(json.dumps(cfg, indent=2))


def prepare_checkpoint(model: HybridMoEModel, directory: Path, dtype: torch.dtype | None = None) -> Path:
    """The target as an HF checkpoint the converter accepts (exact target weights, tokenizer files)."""
    from baselines.export import save_checkpoint

    directory = save_checkpoint(model, directory, dtype)
    if (directory / "specter_tokenizer.json").is_file():  # synthetic model: byte-level ids
        write_byte_tokenizer(directory, model.hf.config.vocab_size, model.tokenizer)
    _fix_config(directory, model.hf.config)
    return directory


def convert(checkpoint: Path, outfile: Path, outtype: str, timeout_s: float = 1800) -> Path:
    """Run llama.cpp's convert_hf_to_gguf.py on `checkpoint` in a subprocess (vendored gguf-py first)."""
    root = converter_root()
    if root is None:
        raise SpecterError(f"llama.cpp converter source not found under {source_dir()}: {SETUP_HINT}")
    paths = [root / "gguf-py", root, Path(__file__).resolve().parent.parent, os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in paths if str(p)))
    cmd = [sys.executable, "-m", "baselines.gguf_convert", "--driver", str(checkpoint), "--outfile", str(outfile),
           "--outtype", outtype]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0 or not outfile.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise SpecterError(f"convert_hf_to_gguf.py failed on {checkpoint}: {' | '.join(tail)}")
    return outfile


def _driver(argv: list[str]) -> None:
    """Inside the subprocess: llama.cpp's converter, given Specter's byte-level vocabulary for synthetic models.

    A synthetic checkpoint (marked by specter_tokenizer.json) has only the byte-level BPE tokenizer, so
    every architecture takes its vocabulary through the converter's GPT-2 path (some would first look
    for a sentencepiece model). The converter names a BPE pre-tokenizer by hashing how a tokenizer splits
    a fixed text and knows only published tokenizers; this one is "default". Token ids are passed to
    llama.cpp directly, never text, so the pre-tokenizer is never used.
    """
    import convert_hf_to_gguf

    if (Path(argv[0]) / "specter_tokenizer.json").is_file():
        model_class = convert_hf_to_gguf.get_model_class

        def byte_vocab_class(*args, **kwargs):
            cls = model_class(*args, **kwargs)
            return type(cls.__name__, (cls,), {"model_arch": cls.model_arch, "set_vocab": cls._set_vocab_gpt2,
                                               "get_vocab_base_pre": lambda self, tokenizer: "default"})
        convert_hf_to_gguf.get_model_class = byte_vocab_class
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--driver"]:
        _driver(sys.argv[2:])
    elif sys.argv[1:] == ["--fetch"]:
        print(fetch_source())
    else:
        sys.exit("usage: python -m baselines.gguf_convert --fetch   (downloads the converter source)")
