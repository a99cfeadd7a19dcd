"""Where a run writes: the results directory's name (sweeps included), never overwritten, resumed only into a run
of the same config."""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

from experiments.settings import run_name
from specter.config import SpecterConfig
from specter.defaults import config_default
from specter.errors import SpecterError

RESUME_FREE = ("resume", "results_dir", "results_root")  # keys a resumed run may change


def results_dir(cfg) -> tuple[Path, bool]:
    """(where this run writes, whether it resumes an earlier run there); never overwrites.

    An explicit results_dir that exists is refused unless resume=true; the default
    results/<experiment>/<model>-<mem>[-<swept overrides>] (<model>: model.label if set, e.g. a checkpoint
    directory's name; the swept overrides in a multirun, e.g. -k2) gets a numeric suffix (.1, .2, ...) instead,
    or with resume=true is continued (its finished cases are skipped). A run resumes only into a directory
    that exists and whose run.json holds the same config (resume=force continues anyway).
    """
    if cfg.resume not in (True, False, "force"):
        raise SpecterError(f"resume must be true, false or force, got {cfg.resume!r}")
    if cfg.results_dir is not None:
        path = Path(cfg.results_dir)
        if path.exists() and not cfg.resume:
            raise SpecterError(f"results directory {path} already exists; it is never overwritten: "
                               f"pass another results_dir= or resume=true")
    else:
        path = Path(cfg.results_root) / cfg.experiment.name / f"{run_name(cfg)}-{cfg.mem.name}{sweep_suffix()}"
        n, base = 0, path
        while path.exists() and not cfg.resume:
            n += 1
            path = base.with_name(f"{base.name}.{n}")
    if cfg.resume and not path.exists():
        raise SpecterError(f"nothing to resume: {path} does not exist (drop resume= to start a new run)")
    if not path.exists():
        check_creatable(path)
    if cfg.resume is True:
        check_same_config(path, cfg)
    return path, bool(cfg.resume)


def check_creatable(path: Path) -> None:
    """One-line error unless `path` can be created (it is not made here): its nearest existing parent must be a
    directory in which a directory can be made, which a temporary one tries (os.access says yes to root even
    where nothing can be made, as under /proc)."""
    parent = path.absolute().parent
    while not os.path.lexists(parent):
        parent = parent.parent
    if not parent.is_dir():
        raise SpecterError(f"results directory {path} cannot be created: {parent} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".specter-probe-", dir=parent))
    except OSError:
        raise SpecterError(f"results directory {path} cannot be created: {parent} is not writable") from None


NAMED_KEYS = ("model", "mem", "results_root", "results_dir", "resume")  # said by the name or not a setting


def sweep_suffix() -> str:
    """In a Hydra multirun job, `-<key><value>` for each of its overrides that the directory name does not
    already say (e.g. `-k2` for k=2, `-spare_rows8` for specter.spare_rows=8); "" in a single run."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
        hydra_cfg = HydraConfig.get()
    except (ImportError, ValueError):  # not under Hydra (a library call or a test)
        return ""
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return ""
    overrides = [override.lstrip("+~").partition("=") for override in hydra_cfg.overrides.task]
    overrides = [(key, value) for key, _, value in overrides
                 if key.split(".")[0] not in NAMED_KEYS and not key.startswith("hydra")]
    swept = swept_from_environment() or swept_keys(sys.argv[1:])  # a launcher's job: the parent's sweep
    if swept & {key for key, _ in overrides}:
        overrides = [(key, value) for key, value in overrides if key in swept]
    parts = [re.sub(r"[^A-Za-z0-9_.]+", "_", f"{key.split('.')[-1]}{value}").strip("_") for key, value in overrides]
    return "".join(f"-{part}" for part in parts)


SWEEP_FUNCTIONS = re.compile(r"^(range|choice|interval|glob)\(")


SWEPT_KEYS_VARIABLE = "SPECTER_SWEPT_KEYS"  # set by experiments.main for the jobs a launcher starts


def swept_from_environment() -> set[str]:
    """The swept keys the launching process put in the environment (a submitit job's argv is the worker's)."""
    return {key for key in os.environ.get(SWEPT_KEYS_VARIABLE, "").split(",") if key}


def swept_keys(argv: list[str]) -> set[str]:
    """The keys of command-line overrides that sweep several values (`k=2,8`, `k=range(2,9,2)`)."""
    keys = set()
    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        depth, top_comma = 0, False
        for char in value:
            depth += (char in "[({") - (char in "])}")
            top_comma |= char == "," and depth == 0
        if sep and (top_comma or SWEEP_FUNCTIONS.match(value)):
            keys.add(key)
    return keys


def check_same_config(path: Path, cfg) -> None:
    """One-line error unless `path`'s run.json was written by a run of the same config (options that run
    did not have yet count as the same at their defaults: `added_at_default`; a directory with neither
    run.json nor records.csv holds nothing to check)."""
    if not (path / "run.json").exists() and not (path / "records.csv").exists():
        return
    try:
        stored = json.loads((path / "run.json").read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        raise SpecterError(f"cannot resume {path}: its run.json is missing or unreadable, so its config "
                           f"cannot be checked; pass another results_dir= or resume=force") from None
    stored, new = flat(stored), flat(OmegaConf.to_container(cfg, resolve=True))
    differ = [key for key in sorted(set(stored) | set(new))
              if key.split(".")[0] not in RESUME_FREE and stored.get(key) != new.get(key)
              and not (key not in stored and added_at_default(key, new[key]))]
    if differ:
        shown = ", ".join(f"{k} ({stored.get(k)!r} there, {new.get(k)!r} now)" for k in differ[:4])
        more = f" and {len(differ) - 4} more" if len(differ) > 4 else ""
        raise SpecterError(f"cannot resume {path}: it was run with another config: {shown}{more}; "
                           f"pass another results_dir=, the same settings, or resume=force")


def added_at_default(key: str, value) -> bool:
    """Whether an option a stored config lacks (added since that run) is at the value that run had in
    effect: a Specter option at SpecterConfig's default, or an option left unset (a token cap of a system
    added since)."""
    group, _, name = key.partition(".")
    if value is None:
        return True
    return group == "specter" and name in SpecterConfig.__dataclass_fields__ and value == config_default(name)


def flat(tree: dict, prefix: str = "") -> dict:
    """{"a.b": leaf} of a nested dict (lists and empty dicts are leaves)."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        out.update(flat(value, f"{name}.") if isinstance(value, dict) and value else {name: value})
    return out
