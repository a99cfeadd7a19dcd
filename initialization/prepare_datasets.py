"""Write prepared prompt files for the paper's datasets: DIR/<name>.jsonl with {"id": i, "prompt": text}.

    python initialization/prepare_datasets.py --output data/prepared                 # all five, 25 prompts each
    python initialization/prepare_datasets.py --output data/prepared --only gsm8k c4 --num-prompts 100 --source hub

Each dataset is read from its local file under `$SPECTER_DATA` (default `../shared/data` next to the
repository) or from the Hugging Face Hub (`--source auto`: the local file if present; GPQA is gated,
log in with `huggingface-cli login` first). Use the files with `dataset=all dataset.path=DIR` or
`dataset=gsm8k dataset.path=DIR/gsm8k.jsonl`. An existing file is never overwritten without `--force`.
A dataset that cannot be loaded is reported as "skipped <name>: <reason>" and the exit code is 1;
other errors are one line on stderr with exit code 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__" and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script: use this checkout's packages

from experiments.datasets import DATASETS, REGISTRY, SOURCES, check_request, load_prompts, locate  # noqa: E402
from specter.cli import run_cli
from specter.errors import SpecterError  # noqa: E402

DEFAULT_NUM_PROMPTS = 25


class OneLineParser(argparse.ArgumentParser):
    """argparse with usage errors as one line (exit 2) instead of the usage block."""

    def error(self, message: str):
        raise SpecterError(message)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="prepare_datasets.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, help="directory for the <name>.jsonl files (created if missing)")
    p.add_argument("--only", nargs="+", metavar="NAME", default=None, help=f"datasets to prepare (default all: {' '.join(DATASETS)})")
    p.add_argument("--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS, help=f"prompts per dataset (default {DEFAULT_NUM_PROMPTS})")
    p.add_argument("--source", choices=SOURCES, default="auto", help="auto (local file if present, else the Hub), local, hub")
    p.add_argument("--force", action="store_true", help="overwrite existing files")
    return p


def targets(output: Path, names: list[str], force: bool) -> dict[str, Path]:
    """name -> output file; an existing file (without --force) is refused before anything is written."""
    if output.exists() and not output.is_dir():
        raise SpecterError(f"output {output} exists and is not a directory")
    files = {name: output / f"{name}.jsonl" for name in names}
    existing = [str(f) for f in files.values() if f.exists()]
    if existing and not force:
        raise SpecterError(f"{', '.join(existing)} already exist(s); refusing to overwrite (use --force)")
    return files


def write_prompts(file: Path, prompts: list[str]) -> None:
    """One {"id", "prompt"} record per line, written to a temporary file and renamed into place."""
    tmp = file.with_name(file.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        for i, text in enumerate(prompts):
            handle.write(json.dumps({"id": i, "prompt": text}, ensure_ascii=False) + "\n")
    tmp.replace(file)


def origin(name: str, source: str) -> str:
    file = locate(name, None, source)
    return str(file) if file is not None else f"the Hugging Face Hub ({REGISTRY[name].repo})"


def run(args: argparse.Namespace) -> int:
    names = list(dict.fromkeys(args.only or DATASETS))
    check_request(names, args.num_prompts, args.source)
    files = targets(Path(args.output), names, args.force)
    Path(args.output).mkdir(parents=True, exist_ok=True)
    skipped = 0
    for name, file in files.items():
        try:
            where = origin(name, args.source)
            prompts = load_prompts(name, args.num_prompts, source=args.source)
        except SpecterError as err:
            print(f"skipped {name}: {err}")
            skipped += 1
            continue
        write_prompts(file, prompts)
        print(f"wrote {file}: {len(prompts)} prompts from {where}")
    return 1 if skipped else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (0 all written, 1 some skipped, 2 an error, printed as one line)."""
    try:
        return run_cli(lambda: run(build_parser().parse_args(argv)))  # usage errors are SpecterErrors
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
