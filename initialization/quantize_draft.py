"""Quantize a model's routed experts to the INT4 draft (GPTQ, or RTN) and save it once per checkpoint.

    python initialization/quantize_draft.py --model tiny-qwen --output drafts/tiny-qwen
    python initialization/quantize_draft.py --model checkpoints/dsv2 --output drafts/dsv2 --device cuda \\
        --calibration gsm8k --num-prompts 128 --tokens 512
    python initialization/quantize_draft.py --model dsv2 --synthetic --output drafts/dsv2-synthetic \\
        --calibration text --calibration-file notes.txt

Calibration (default: GSM8K test questions when `$SPECTER_DATA/gsm8k/test.jsonl` is present,
`$SPECTER_DATA` defaulting to `../shared/data` next to the repository; otherwise a few built-in
prompts): `gsm8k` takes a seeded sample of `--num-prompts` questions (jsonl, "question" field), each cut
to `--tokens` tokens; `wikitext2` and `text` (plain text) take `--num-prompts` seeded random windows of
`--tokens` tokens of the whole file; a `text` file ending in .jsonl is read as records with a
"question" or "text" field. Text is tokenized with `model.tokenizer(text)["input_ids"]`.

Writes `draft.safetensors` and `draft.json` (see specter/quant/draft_io.py) into `--output`, which must
not exist or be empty. Errors are one line on stderr with exit code 2 (SPECTER_DEBUG=1 shows tracebacks).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__" and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script: use this checkout's specter package

import torch  # noqa: E402

import specter  # noqa: E402
from specter.cli import run_cli  # noqa: E402
from specter.errors import SpecterError  # noqa: E402
from specter.models.loading import check_model_source  # noqa: E402
from specter.quant.draft_io import MANIFEST_FILE, WEIGHTS_FILE, save_draft  # noqa: E402
from specter.quant.gptq import quantize_experts_gptq, quantize_experts_rtn  # noqa: E402

DEFAULT_FILES = {"gsm8k": Path("gsm8k") / "test.jsonl", "wikitext2": Path("wikitext2") / "wiki.test.tokens"}
BUILTIN_PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    "    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "The tower is 324 metres tall, about the same height as an 81-storey building, and the tallest structure in Paris.",
    "Question: Which of the following is a noble gas? (A) oxygen (B) argon (C) nitrogen (D) chlorine. Answer:",
    "Robert Boulter is an English film, television and theatre actor. He had a guest-starring role on the "
    "television series The Bill in 2000.",
]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def data_dir() -> Path:
    return Path(os.environ.get("SPECTER_DATA", ROOT.parent / "shared" / "data"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quantize_draft.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="registered name (tiny, tiny-qwen, dsv2, ...) or HF checkpoint dir")
    p.add_argument("--synthetic", action="store_true", default=None,
                   help="build the registered architecture with seeded random weights (default for tiny models)")
    p.add_argument("--weights", choices=("synthetic", "calibrated"), default=None,
                   help="seeded weights of a registered model: synthetic (random) or calibrated (real routing "
                        "locality; see README)")
    p.add_argument("--layers", type=int, default=None, help="with --weights: build this many decoder layers")
    p.add_argument("--seed", type=int, default=0, help="synthetic-weight seed and calibration sampling seed")
    p.add_argument("--output", required=True, help="new (or empty) directory for draft.safetensors + draft.json")
    p.add_argument("--calibration", choices=("gsm8k", "wikitext2", "text"), default=None,
                   help="calibration data (default: gsm8k when its file is present, else built-in prompts)")
    p.add_argument("--calibration-file", default=None, help="path of the calibration file (required for text)")
    p.add_argument("--num-prompts", type=int, default=128, help="calibration sequences (default 128)")
    p.add_argument("--tokens", type=int, default=512, help="tokens per calibration sequence, at most (default 512)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: float16 on cuda, float32 on cpu")
    p.add_argument("--method", choices=("gptq", "rtn"), default="gptq")
    p.add_argument("--experts-on-host", action="store_true",
                   help="keep the FP experts in host memory (when they do not fit on the device); each routed "
                        "expert is copied to the device while calibrating")
    p.add_argument("--layers-per-pass", type=int, default=None,
                   help="MoE layers whose Hessians are held at once (default: as many as fit in 4 GiB)")
    return p


def check_output(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise SpecterError(f"output {path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()):
        raise SpecterError(f"output directory {path} exists and is not empty; refusing to overwrite, choose a new one")


def calibration_texts(kind: str | None, file: str | None, method: str) -> tuple[str, Path | None, list[str] | str]:
    """(kind, file, texts) where texts is a list of prompts (records) or one string (windowed later)."""
    if method == "rtn" and kind is None and file is None:
        return "none", None, []
    if kind is None:
        default = data_dir() / DEFAULT_FILES["gsm8k"]
        if file is None and not default.is_file():
            print(f"note: {default} not found; calibrating on {len(BUILTIN_PROMPTS)} built-in prompts",
                  file=sys.stderr)
            return "builtin", None, list(BUILTIN_PROMPTS)
        kind = "gsm8k"
    if file is None:
        if kind == "text":
            raise SpecterError("--calibration text needs --calibration-file FILE")
        path = data_dir() / DEFAULT_FILES[kind]
    else:
        path = Path(file)
    if not path.is_file():
        raise SpecterError(f"calibration file {path} not found (set --calibration-file or SPECTER_DATA)")
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecterError(f"cannot read calibration file {path}: {type(exc).__name__}") from None
    if kind == "gsm8k" or path.suffix == ".jsonl":
        records = []
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise SpecterError(f"{path}:{n} is not valid JSON (expected jsonl with a \"question\" field)") from None
            text = record.get("question", record.get("text")) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise SpecterError(f"{path}:{n} has no \"question\" or \"text\" string field")
            records.append(text)
        if not records:
            raise SpecterError(f"calibration file {path} has no records")
        return kind, path, records
    if not raw.strip():
        raise SpecterError(f"calibration file {path} is empty")
    return kind, path, raw


def calibration_ids(model, texts: list[str] | str, num_prompts: int, tokens: int, seed: int) -> list[torch.Tensor]:
    """LongTensor [1, <=tokens] sequences: a seeded sample of records, or seeded windows of one long text."""
    rng = random.Random(seed)
    if isinstance(texts, str):
        ids = model.tokenizer(texts)["input_ids"]
        if len(ids) <= tokens:
            return [torch.tensor([ids])]
        starts = [rng.randrange(0, len(ids) - tokens + 1) for _ in range(num_prompts)]
        return [torch.tensor([ids[s:s + tokens]]) for s in starts]
    chosen = texts if len(texts) <= num_prompts else rng.sample(texts, num_prompts)
    out = [torch.tensor([model.tokenizer(t)["input_ids"][:tokens]]) for t in chosen]
    return [t for t in out if t.shape[-1] > 0]


def format_report(report: dict) -> str:
    lines = [f"quantizer {report['quantizer']}, group {report['group_size']}, {report['num_prompts']} calibration "
             f"prompts, {report['calibration_tokens']} tokens, {report['seconds']:.1f} s"]
    for row in report["layers"]:
        if report["quantizer"] == "gptq":
            lines.append(f"  MoE layer {row['layer']}: {row['gptq_experts']} GPTQ, {row['rtn_fallback_experts']} "
                         f"RTN fallback (never routed)")
        else:
            lines.append(f"  MoE layer {row['layer']}: {row['rtn_experts']} RTN")
    if report["quantizer"] == "gptq":
        lines.append(f"total: {report['gptq_experts']} GPTQ, {report['rtn_fallback_experts']} RTN fallback")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> Path:
    output = Path(args.output)
    check_output(output)
    if args.num_prompts < 1 or args.tokens < 1:
        raise SpecterError("--num-prompts and --tokens must be at least 1")
    if args.layers_per_pass is not None and args.layers_per_pass < 1:
        raise SpecterError("--layers-per-pass must be at least 1")
    check_model_source(args.model)  # a bad model is reported before anything else is read
    kind, path, texts = calibration_texts(args.calibration, args.calibration_file, args.method)
    model = specter.load_model(args.model, synthetic=args.synthetic, device=args.device,
                               dtype=DTYPES[args.dtype] if args.dtype else None, seed=args.seed,
                               experts_on_host=args.experts_on_host, weights=args.weights, num_layers=args.layers)
    if args.method == "gptq":
        ids = calibration_ids(model, texts, args.num_prompts, args.tokens, args.seed)
        if not ids:
            raise SpecterError("the calibration data gave no tokens")
        report = quantize_experts_gptq(model, ids, layers_per_pass=args.layers_per_pass, progress=True)
    else:
        report = quantize_experts_rtn(model, progress=True)
    extra = {
        "source": {"model": args.model, "synthetic": args.synthetic, "weights": args.weights, "layers": args.layers,
                   "seed": args.seed,
                   "device": str(model.device), "dtype": str(model.dtype).removeprefix("torch.")},
        "calibration": {"kind": kind, "file": str(path) if path else None, "num_prompts": args.num_prompts,
                        "tokens": args.tokens},
        "report": report,
        "specter_version": specter.__version__,
    }
    save_draft(model, output, extra=extra)
    print(format_report(report))
    print(f"wrote {output / WEIGHTS_FILE} and {output / MANIFEST_FILE}")
    return output


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (0 ok, 2 for any error, printed as one line)."""
    args = build_parser().parse_args(argv)
    return run_cli(lambda: run(args) and 0)


if __name__ == "__main__":
    sys.exit(main())
