"""`python -m specter generate`: decode a text prompt with Specter, stream the text, summarize the run on stderr;
`python -m specter serve`: an OpenAI-compatible server over one model."""
from __future__ import annotations

import argparse
import math
import sys

import torch

from specter.cli import run_cli
from specter.config import SpecterConfig
from specter.engine import SpecterEngine
from specter.errors import SpecterError
from specter.models.loading import check_model_source, load_model
from specter.device.budget import plan_memory
from specter.text import check_request, generate_text, printable

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KNOWN_MECHANISMS = ("draft_graph", "draft_ahead")  # stats that say whether a mechanism ran, before "mechanisms"


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are SpecterErrors (one `error:` line and exit 2 through run_cli)."""

    def error(self, message: str):
        raise SpecterError(message)


def memory(value: str) -> str | float:
    """--mem: a named preset (high, low) or a GPU budget in GB."""
    if value in ("high", "low"):
        return value
    try:
        gb = float(value)
    except ValueError:
        gb = math.nan
    if not math.isfinite(gb) or gb <= 0:
        raise argparse.ArgumentTypeError(f"must be high, low or a number of GB above 0, got {value!r}")
    return gb


def parser() -> Parser:
    top = Parser(prog="python -m specter", description="Speculative MoE inference with offloaded experts.")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = commands.add_parser("generate", help="continue a text prompt (or answer it with --chat)",
                              description="Decode a prompt with Specter; the text streams to stdout, a summary "
                                          "line goes to stderr.")
    gen.add_argument("prompt", help="the prompt text")
    add_model_arguments(gen, "a registered model name (tiny, tiny-qwen, dsv2, qwen, ...) or a checkpoint directory")
    gen.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to the prompt")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="at most this many new tokens (default 128)")
    srv = commands.add_parser("serve", help="an OpenAI-compatible server (needs the serve extra)",
                              description="Serve /v1/completions, /v1/chat/completions, /v1/models and /health "
                                          "over one model, loaded once at start-up.")
    add_model_arguments(srv, "a registered model name or a checkpoint directory")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    srv.add_argument("--max-batch", type=int, default=16,
                     help="greedy requests decoded together at most (default 16)")
    return top


def add_model_arguments(command, model_help: str) -> None:
    """The arguments both commands take: the model, its memory setting, K, the device and the dtype."""
    command.add_argument("--model", required=True, help=model_help)
    command.add_argument("--mem", required=True, type=memory, help="resident experts per layer: the model's "
                                                                   "preset high or low, or a GPU budget in GB")
    command.add_argument("--k", type=int, default=None, help="draft tokens per iteration (default: the model's)")
    command.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    command.add_argument("--dtype", choices=tuple(DTYPES), default="auto",
                         help="auto: float32 on the CPU, the checkpoint's dtype on CUDA")


def checked_device(args: argparse.Namespace) -> str | None:
    """The model arguments checked before anything loads (an unknown name, a missing directory, no CUDA for
    --device cuda, K < 1: one line each); the device to load on (None: the default)."""
    check_model_source(args.model)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SpecterError("--device cuda: no CUDA device is available here (use --device cpu)")
    if args.k is not None and args.k < 1:
        raise SpecterError(f"--k must be an integer >= 1, got {args.k}")
    return None if args.device == "auto" else args.device


def resident_slots(model, mem: str | float) -> int:
    """FP expert slots per MoE layer: the spec's preset, or as many as a GB budget holds."""
    if isinstance(mem, str):
        return int(model.spec.mem_presets[mem])
    return plan_memory(model.spec, model.hf.config, model.dtype).slots_for(mem)


def mechanisms(stats: dict) -> str:
    """`name on, name off (why), ...` from stats["mechanisms"], else from the stats that say it."""
    found = stats.get("mechanisms") or {k: stats[k] for k in KNOWN_MECHANISMS if isinstance(stats.get(k), str)}
    parts = []
    for name, state in found.items():
        word, _, why = str(state).partition(":")
        parts.append(f"{name} {word.strip()}" + (f" ({why.strip()})" if why.strip() else ""))
    return ", ".join(parts) or "none reported"


def summary(result) -> str:
    stats = result.stats
    tpot, rate = stats.get("tpot_ms", math.nan), stats.get("acceptance_rate", math.nan)
    tpot_text = f"{tpot:.1f} ms" if math.isfinite(tpot) else "n/a"
    rate_text = f"{rate:.2f}" if math.isfinite(rate) else "n/a"
    return (f"[{len(result.token_ids)} tokens, TPOT {tpot_text}, acceptance {rate_text}, "
            f"mechanisms: {mechanisms(stats)}]")


def random_weights_note(model) -> str | None:
    """The stderr line for a model whose weights are seeded random numbers (a registered tiny model: it has no
    checkpoint, so it is built synthetic), whose text means nothing; None for a checkpoint."""
    if not model.spec.is_tiny:
        return None
    return f"note: {model.spec.name} has random weights (no checkpoint), so its text is not meaningful"


def generate(args: argparse.Namespace) -> int:
    check_request(args.prompt, args.max_new_tokens)
    device = checked_device(args)
    model = load_model(args.model, device=device, dtype=DTYPES[args.dtype], keep_raw_experts=False)  # Specter alone
    k = model.spec.default_k if args.k is None else args.k
    config = SpecterConfig(k=k, resident_experts_per_layer=resident_slots(model, args.mem))
    engine = SpecterEngine(model, config, keep_raw_experts=False)  # Specter alone: the host keeps the blobs only
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")  # a console that cannot show a character shows "?"
    result = generate_text(engine, args.prompt, args.max_new_tokens, chat=args.chat,
                           stream=lambda piece: print(printable(piece), end="", flush=True))
    print(flush=True)
    if note := random_weights_note(model):
        print(note, file=sys.stderr, flush=True)
    print(summary(result), file=sys.stderr, flush=True)
    return 0


def serve(args: argparse.Namespace) -> int:
    """Check the arguments, then serve until interrupted while the model loads in the background."""
    device = checked_device(args)
    if args.max_batch < 1:
        raise SpecterError(f"--max-batch must be >= 1, got {args.max_batch}")
    try:
        from specter.serve.engines import load_served
        from specter.serve.server import run_server
    except ImportError as err:
        raise SpecterError(f"serve needs the serve extra ({err.name} is missing): "
                           f"python3 -m pip install -e \".[serve]\"") from None
    run_server(lambda: load_served(args.model, lambda model: resident_slots(model, args.mem), k=args.k,
                                   device=device, dtype=DTYPES[args.dtype]),
               args.host, args.port, args.max_batch)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command line's exit code: 0, or 2 after one `error: ...` line on stderr."""

    def run() -> int:
        args = parser().parse_args(argv)
        return serve(args) if args.command == "serve" else generate(args)

    return run_cli(run)


if __name__ == "__main__":
    sys.exit(main())
