"""Prompts of the paper's five datasets from local files (jsonl[.gz], csv[.zip], WikiText tokens) or the HF Hub."""
from __future__ import annotations

import contextlib
import csv
import gzip
import io
import json
import os
import re
import socket
import zipfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from specter.errors import SpecterError, first_line

ROOT = Path(__file__).resolve().parent.parent
DATASETS = ("gsm8k", "wikitext2", "humaneval", "gpqa", "c4")
SOURCES = ("auto", "local", "hub")
GPQA_PASSWORD = b"deserted-untie-orchid"  # the GPQA authors' published convention for their zip files
HEADING = re.compile(r"^ ?=+ .* =+ ?$")  # a WikiText article or section heading line
PREPARED_FIELD = "prompt"  # the field of files written by initialization/prepare_datasets.py
PREPARE_HINT = "run `python initialization/prepare_datasets.py --output DIR` and pass dataset.path=DIR, or set SPECTER_DATA"


@dataclass(frozen=True)
class DatasetSpec:
    """Where a dataset comes from: the Hub (`datasets.load_dataset` arguments) and its default local file(s)."""

    name: str
    repo: str                     # load_dataset(path=...)
    config: str | None            # load_dataset(name=...)
    split: str
    field: str                    # the prompt field (a jsonl key or csv column)
    files: tuple[str, ...]        # default files under the data dir, first existing wins
    parser: str                   # format of a file whose suffix says nothing: jsonl, csv, wikitext
    data_files: str | None = None  # load_dataset(data_files={split: ...})
    lines: bool = False           # one prompt per stripped non-heading line (WikiText)


REGISTRY = {
    "gsm8k": DatasetSpec("gsm8k", "openai/gsm8k", "main", "test", "question", ("gsm8k/test.jsonl",), "jsonl"),
    "wikitext2": DatasetSpec("wikitext2", "Salesforce/wikitext", "wikitext-2-v1", "test", "text",
                             ("wikitext2/wiki.test.tokens",), "wikitext", lines=True),
    "humaneval": DatasetSpec("humaneval", "openai/openai_humaneval", None, "test", "prompt",
                             ("humaneval/HumanEval.jsonl.gz",), "jsonl"),
    "gpqa": DatasetSpec("gpqa", "Idavidrein/gpqa", "gpqa_main", "train", "Question",
                        ("gpqa/gpqa_main.csv", "gpqa/gpqa_main.csv.zip"), "csv"),
    "c4": DatasetSpec("c4", "allenai/c4", None, "validation", "text", ("c4/c4-validation.00000-of-00008.json.gz",),
                      "jsonl", data_files="en/c4-validation.00000-of-00008.json.gz"),
}


def data_dir() -> Path:
    """`$SPECTER_DATA`, default `../shared/data` next to the repository."""
    return Path(os.environ.get("SPECTER_DATA", ROOT.parent / "shared" / "data"))


def local_datasets() -> list[str]:
    """The registered datasets whose local file is under `data_dir()`, in registry order."""
    return [name for name in REGISTRY if any(f.is_file() for f in default_files(name))]


def get_spec(name: str) -> DatasetSpec:
    if name not in REGISTRY:
        raise SpecterError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    return REGISTRY[name]


def default_files(name: str) -> list[Path]:
    """The local files looked for when no path is given, in order of preference."""
    return [data_dir() / f for f in get_spec(name).files]


def locate(name: str, path: str | os.PathLike | None = None, source: str = "auto") -> Path | None:
    """The local file to read, or None for the Hub; a missing file with source 'local' is an error.

    A directory `path` means a directory of prepared files: `<path>/<name>.jsonl`.
    """
    spec = get_spec(name)
    check_request([name], 1, source)
    if path is not None:
        if source == "hub":
            raise SpecterError(f"{name}: dataset.path={path} and source=hub exclude each other")
        file = Path(path) / f"{name}.jsonl" if Path(path).is_dir() else Path(path)
        if not file.is_file():
            raise SpecterError(f"{name}: file {file} not found")
        return file
    if source == "hub":
        return None
    found = next((f for f in default_files(name) if f.is_file()), None)
    if found is None and source == "local":
        where = " or ".join(str(f) for f in default_files(name))
        raise SpecterError(f"{spec.name}: no local file at {where}; {PREPARE_HINT}")
    return found


def load_prompts(name: str, num_prompts: int, path: str | None = None, source: str = "auto") -> list[str]:
    """The first `num_prompts` non-empty prompts of dataset `name`, in file order."""
    spec = get_spec(name)
    check_request([name], num_prompts, source)
    num_prompts = int(num_prompts)
    file = locate(name, path, source)
    if file is not None:
        return read_file(spec, file, num_prompts)
    try:
        return hub_prompts(spec, num_prompts)
    except SpecterError as err:
        if source == "auto":
            files = ", ".join(spec.files)
            raise SpecterError(f"{name}: no local file ({files} under {data_dir()}) and {err}; "
                               f"see initialization/prepare_datasets.py") from None
        raise


def file_format(spec: DatasetSpec, file: Path) -> str:
    """zip, csv or jsonl from the file's suffix, else the dataset's own format."""
    name = file.name.lower()
    if name.endswith(".zip"):
        return "zip"
    if name.endswith(".csv"):
        return "csv"
    return "jsonl" if name.endswith((".jsonl", ".jsonl.gz", ".json.gz")) else spec.parser


@contextlib.contextmanager
def open_text(file: Path, fmt: str) -> Iterator[Iterable[str]]:
    """The file as text lines: gzip by suffix; a zip's one csv opened with the GPQA password."""
    if fmt == "zip":
        with zipfile.ZipFile(file) as archive, archive.open(zip_member(archive, file), pwd=GPQA_PASSWORD) as raw:
            yield io.TextIOWrapper(raw, encoding="utf-8-sig", newline="")
        return
    opener = gzip.open if file.name.lower().endswith(".gz") else open
    csv_like = fmt == "csv"
    with opener(file, "rt", encoding="utf-8-sig" if csv_like else "utf-8", newline="" if csv_like else None) as handle:
        yield handle


def read_file(spec: DatasetSpec, file: Path, num_prompts: int) -> list[str]:
    """Read a local file in the format its suffix names (else the dataset's own format)."""
    fmt = file_format(spec, file)
    reader = {"jsonl": jsonl_records, "csv": csv_records, "zip": csv_records, "wikitext": text_records}[fmt]
    try:
        with open_text(file, fmt) as handle:
            return take(spec, file, reader(file, handle, spec.field), num_prompts)
    except RuntimeError as exc:  # zipfile: bad password, unsupported encryption
        raise SpecterError(f"cannot open {file}: {first_line(exc)}") from None
    except (OSError, EOFError, UnicodeDecodeError, zipfile.BadZipFile, zlib.error, csv.Error) as exc:
        raise SpecterError(f"cannot read {file}: {type(exc).__name__}: {first_line(exc)}") from None


def take(spec: DatasetSpec, file: Path | str, records: Iterable[str], num_prompts: int) -> list[str]:
    """The first `num_prompts` usable prompts of `records`; an error when there are none."""
    prompts, seen = [], False
    for text in records:
        seen = True
        prompt = clean(spec, text)
        if prompt is not None:
            prompts.append(prompt)
            if len(prompts) == num_prompts:
                break
    if not seen:
        raise SpecterError(f"{file} is empty")
    if not prompts:
        raise SpecterError(f"{file} has no usable {spec.name} prompt (no non-empty {spec.field!r} text)")
    return prompts


def clean(spec: DatasetSpec, text: str) -> str | None:
    """The prompt a record's text gives, or None to skip it (blank; WikiText: also headings)."""
    if spec.lines:
        line = text.rstrip("\r\n")
        return None if not line.strip() or HEADING.match(line) else line.strip()
    return text if text.strip() else None


def jsonl_records(file: Path, handle: Iterable[str], field: str) -> Iterator[str]:
    """The `field` (else "prompt") string of each jsonl record; blank lines are skipped."""
    for n, line in enumerate(handle, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise SpecterError(f"{file}:{n} is not valid JSON") from None
        yield record_text(record, field, f"{file}:{n}")


def record_text(record, field: str, where: str) -> str:
    """A record's prompt: `field`, else the prepared-file field "prompt"; a string or an error."""
    if not isinstance(record, dict):
        raise SpecterError(f"{where} is not a JSON object")
    text = record.get(field, record.get(PREPARED_FIELD))
    if not isinstance(text, str):
        fields = f"{field!r}" if field == PREPARED_FIELD else f"{field!r} or {PREPARED_FIELD!r}"
        raise SpecterError(f"{where} has no {fields} string field")
    return text


def csv_records(file: Path, handle: Iterable[str], field: str) -> Iterator[str]:
    """The `field` (else "prompt") column of each csv row."""
    reader = csv.DictReader(handle)
    if reader.fieldnames is None:
        return
    column = field if field in reader.fieldnames else PREPARED_FIELD
    if column not in reader.fieldnames:
        raise SpecterError(f"{file} has no {field!r} column")
    for row in reader:
        yield row[column] or ""


def zip_member(archive: zipfile.ZipFile, file: Path) -> str:
    """The one csv in the zip (with several, the one named like the zip: gpqa_main.csv.zip -> gpqa_main.csv)."""
    names = [n for n in archive.namelist() if n.lower().endswith(".csv") and not n.startswith("__MACOSX")]
    if len(names) > 1:
        names = [n for n in names if Path(n).name == file.name.removesuffix(".zip")] or names
    if len(names) != 1:
        raise SpecterError(f"{file} holds {len(names)} csv files, expected one")
    return names[0]


def text_records(file: Path, handle: Iterable[str], field: str) -> Iterator[str]:
    """Every line of a raw text file (WikiText tokens); `clean` drops blanks and headings."""
    yield from handle


def hub_prompts(spec: DatasetSpec, num_prompts: int) -> list[str]:
    """The first prompts of the dataset's Hub split, through `datasets.load_dataset`."""
    try:
        import datasets
    except ImportError:
        raise SpecterError("the Hub needs the 'datasets' package (pip install datasets)") from None
    kwargs = {"split": spec.split}
    if spec.config is not None:
        kwargs["name"] = spec.config
    if spec.data_files is not None:
        kwargs["data_files"] = {spec.split: spec.data_files}
    where = f"Hugging Face Hub {spec.repo}" + (f" ({spec.config})" if spec.config else "")
    problem = hub_problem()
    if problem:
        raise SpecterError(f"cannot load {spec.name} from the Hub: {problem}")
    try:
        rows = datasets.load_dataset(spec.repo, **kwargs)
    except Exception as exc:  # authentication (GPQA is gated), missing repo: one short line either way
        reason = first_line(exc)
        reason = reason if len(reason) <= 160 else reason[:157] + "..."
        raise SpecterError(f"cannot load {spec.name} from the {where}: {type(exc).__name__}: {reason}") from None
    records = (record_text(row, spec.field, f"{where} row {i}") for i, row in enumerate(rows))
    return take(spec, where, records, num_prompts)


def hub_problem(timeout_s: float = 3.0) -> str:
    """Why the Hub cannot be read right now ("" when it may be): offline mode, or no connection to its host
    within `timeout_s` (checked once, before `datasets` starts its own retry loop)."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"offline mode ({name}={os.environ[name]})"
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = re.sub(r"^[a-z]+://", "", endpoint).split("/")[0]
    host, _, port = host.partition(":")
    try:
        socket.create_connection((host, int(port or 443)), timeout=timeout_s).close()
    except (OSError, ValueError):
        return f"{host} is unreachable (no network?)"
    return ""


def _get(node, key: str, default=None):
    """`node[key]` for a mapping (dict, OmegaConf DictConfig) or an attribute; `default` when absent."""
    if hasattr(node, "get"):
        return node.get(key, default)
    return getattr(node, key, default)


def check_request(names: list[str], num_prompts: int, source: str) -> None:
    """Known names, a known source, at least one prompt; else a one-line error."""
    for name in names:
        get_spec(name)
    if source not in SOURCES:
        raise SpecterError(f"unknown dataset source {source!r}; known: {', '.join(SOURCES)}")
    if int(num_prompts) < 1:
        raise SpecterError(f"num_prompts must be at least 1, got {num_prompts}")


def prompts_for(dataset_cfg, num_prompts: int) -> dict[str, list[str] | str]:
    """Dataset name -> its first `num_prompts` prompts, from the Hydra `dataset` node.

    `prompts: [...]` (builtin) gives those prompts. `members: [...]` loads each member with the node's
    `path` and `source`. With several members (or `name: all`) a member that cannot be loaded gives the
    string "unavailable: <reason>" instead of its prompts; a single dataset's errors propagate.
    """
    name = str(_get(dataset_cfg, "name", "builtin"))
    prompts = _get(dataset_cfg, "prompts")
    if prompts is not None:
        if not list(prompts):
            raise SpecterError(f"dataset {name} has no prompts")
        return {name: [str(p) for p in list(prompts)[: int(num_prompts)]]}
    members = [str(m) for m in (_get(dataset_cfg, "members") or [name])]
    path, source = _get(dataset_cfg, "path"), str(_get(dataset_cfg, "source", "auto") or "auto")
    check_request(members, num_prompts, source)  # config errors are never "unavailable"
    if len(members) == 1 and name != "all":
        return {members[0]: load_prompts(members[0], num_prompts, path, source)}
    if path is not None and not Path(str(path)).is_dir():
        raise SpecterError(f"dataset {name}: path {path} must be a directory of prepared <name>.jsonl files")
    out: dict[str, list[str] | str] = {}
    for member in members:
        try:
            out[member] = load_prompts(member, num_prompts, path, source)
        except SpecterError as err:
            out[member] = f"unavailable: {err}"
    return out
