"""Entry point of every experiment: compose the config, run it, write records/summary/run.json, print a table.

    python -m experiments.main                                  # tiny default on CPU (main comparison)
    python -m experiments.main model=dsv2 mem=low dataset=all   # the paper's protocol on a checkpoint
    python -m experiments.main experiment=depth                 # also: prefix, routing, kernel
    python -m experiments.main model=/models/Mixtral-8x7B       # any HF checkpoint directory of the four architectures
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from omegaconf import OmegaConf

from experiments import records
from experiments.experiments import EXPERIMENTS
from experiments.link import RunLink, pinned_sources
from experiments.machine import busy_warning, load_note, machine_state, peak_memory
from experiments.override_keys import check_override_keys
from experiments.run_dirs import SWEEP_FUNCTIONS, SWEPT_KEYS_VARIABLE, results_dir, swept_keys
from experiments.run_model import expert_placement
from experiments.settings import check_run_settings, earlier_invocations, invocation, write_run_json
from experiments.usage import usage
from specter.errors import SpecterError
from specter.models.loading import checkpoint_architecture

CONF = Path(__file__).resolve().parent.parent / "conf"
CHECKED_GROUPS = ("model", "mem", "dataset", "experiment", "specter")
HYDRA_SPECIAL = re.compile(r"([\\()\[\]{}:=, \t])")  # characters Hydra's override grammar needs escaped


def names_checkpoint(option: str) -> bool:
    """Whether a `model=` value is a checkpoint directory: not a conf/model option, and an existing path
    or anything with a path separator."""
    if (CONF / "model" / f"{option}.yaml").is_file():
        return False
    return Path(option).exists() or "/" in option or os.sep in option


def checkpoint_overrides(argv: list[str]) -> list[str]:
    """argv with `model=<checkpoint dir>` rewritten, before Hydra composes, into
    `model=<its architecture> model.checkpoint=<dir> model.weights=checkpoint model.label=<dir name>`.

    The architecture is the registered one of config.json's model_type (its conf/model file gives K and
    the memory presets); the label names the results directory. A model.weights= or model.label= the
    command line gives itself wins; a second checkpoint (model.checkpoint=) is refused.
    """
    given = {arg.partition("=")[0].lstrip("+~") for arg in argv if "=" in arg}
    out: list[str] = []
    for arg in argv:
        group, sep, option = arg.partition("=")
        if group != "model" or not sep or not names_checkpoint(option):
            out.append(arg)
            continue
        if "model.checkpoint" in given:
            raise SpecterError(f"model={option} already names the checkpoint directory: drop model.checkpoint=")
        path = Path(option)
        spec = checkpoint_architecture(path)
        out += [f"model={spec.name}", f"model.checkpoint={hydra_escape(str(path))}"]
        if "model.weights" not in given:
            out.append("model.weights=checkpoint")
        label = path.resolve().name
        if "model.label" not in given and label:
            out.append(f"model.label={hydra_escape(label)}")
    return out


def hydra_escape(value: str) -> str:
    """A value as one Hydra override value (paths may hold spaces, commas, colons, brackets)."""
    return HYDRA_SPECIAL.sub(r"\\\1", value)


def check_group_choices(argv: list[str]) -> None:
    """One-line error for `group=option` overrides naming an option file that does not exist (each option of
    a multirun's `group=a,b`; a sweep function such as choice(...) is left to Hydra)."""
    for arg in argv:
        group, sep, value = arg.partition("=")
        if not sep or group not in CHECKED_GROUPS or not (CONF / group).is_dir() or SWEEP_FUNCTIONS.match(value):
            continue
        for option in value.split(",") if group in swept_keys([arg]) else [value]:
            if not (CONF / group / f"{option}.yaml").is_file():
                known = ", ".join(sorted(p.stem for p in (CONF / group).glob("*.yaml")))
                raise SpecterError(f"unknown {group} {option!r}; known: {known}")


def system_overrides(argv: list[str]) -> list[str]:
    """argv with `system=X` (also `+system=X`) rewritten into `systems=[X]`: the one system X, an option file
    of conf/system/. An unknown X, or system= beside systems=, is a one-line error."""
    chosen = [arg for arg in argv if arg.lstrip("+~").partition("=")[0] == "system"]
    if not chosen:
        return argv
    known = sorted(p.stem for p in (CONF / "system").glob("*.yaml"))
    if len(chosen) > 1 or any(arg.lstrip("+~").partition("=")[0] == "systems" for arg in argv):
        raise SpecterError("give one system=X (one system) or systems=[a,b,...] (several), not both")
    name = chosen[0].partition("=")[2]
    if chosen[0].startswith("~") or name not in known:
        raise SpecterError(f"unknown system {name!r}; known: {', '.join(known)} (several: systems=[a,b,...])")
    return [f"systems=[{name}]" if arg is chosen[0] else arg for arg in argv]


def token_cap_overrides(argv: list[str]) -> list[str]:
    """argv with `token_caps.X=N` written as `++token_caps.X=N` (token_caps starts empty: any system can be
    capped without a list of every system's name)."""
    return [f"++{arg}" if arg.startswith(("token_caps.", "token_caps=")) else arg for arg in argv]


def check_known_keys(cfg: DictConfig) -> None:
    """One-line error for a top-level key that no code reads (`+foo=1`), before anything runs."""
    base = OmegaConf.load(CONF / "config.yaml")
    known = {key for key in base if key not in ("defaults", "hydra")} | set(CHECKED_GROUPS)
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise SpecterError(f"unknown option {unknown[0]}= (no code reads it); top-level options: "
                           f"{', '.join(sorted(known))}; see --help")


def run(cfg: DictConfig) -> Path:
    """Run the configured experiment; returns the results directory it wrote."""
    check_known_keys(cfg)
    check_run_settings(cfg)
    out_dir, resumed = results_dir(cfg)
    if resumed and cfg.resume is True and run_complete(out_dir):
        return nothing_to_do(cfg, out_dir)
    machine = machine_state(cfg.device)  # measured once: the header, the warning and run.json show it
    experts = expert_placement(cfg)  # before anything loads: the choice load_model makes
    opened: list[records.RecordWriter] = []
    calls: list[dict] = []  # run.json's invocations: the earlier ones (on resume) and this process
    links: list[RunLink] = []  # this process's link, measured after the warm-ups

    def save(complete: bool) -> None:
        link = links[0].as_dict() if links else None
        if calls:
            calls[-1]["h2d"] = link
            calls[-1]["peak_memory"] = peak_memory()
        write_run_json(out_dir, cfg, complete=complete, invocations=calls, machine=machine, h2d=link, experts=experts)

    def open_writer(model=None) -> records.RecordWriter:
        """Create the results directory only once the inputs are valid and the model is loaded; the writer's
        link measures `model`'s pinned memory."""
        out_dir.mkdir(parents=True, exist_ok=resumed)
        calls.extend(earlier_invocations(out_dir) if resumed else [])
        device = model.device if model is not None else "cpu"
        links.append(RunLink(device, lambda: pinned_sources(model), lambda _: save(complete=False)))
        writer = records.RecordWriter(out_dir, resume=resumed, link=links[0], invocation=len(calls))
        calls.append(invocation(cfg, len(writer.rows), machine))
        save(complete=False)
        opened.append(writer)
        return writer

    header, by = EXPERIMENTS[cfg.experiment.name](cfg, out_dir, open_writer)
    summary = records.write_summary(out_dir, opened[0].rows, by)
    save(complete=True)
    print(f"\n{header}{load_note(machine, links[0].as_dict() if links else None)}")
    print(records.format_table(summary))
    print(f"results: {out_dir}")
    busy = busy_warning(machine)
    if busy:
        print(busy, file=sys.stderr)
    return out_dir


def run_complete(out_dir: Path) -> bool:
    """Whether `out_dir`'s run.json says its run finished."""
    try:
        return json.loads((out_dir / "run.json").read_text()).get("complete") is True
    except (OSError, ValueError, AttributeError):
        return False


def nothing_to_do(cfg: DictConfig, out_dir: Path) -> Path:
    """A resumed run that had finished: say so and print its summary."""
    rows = records.read_records(out_dir / "records.csv") if (out_dir / "records.csv").is_file() else None
    print(f"nothing to do: every case of {out_dir} is done")
    if rows is not None and not rows.empty:
        print(records.format_table(records.summarize(rows, records.SUMMARY_KEYS[cfg.experiment.name])))
    print(f"results: {out_dir}")
    return out_dir


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except SpecterError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    if {"--help", "-h"} & set(sys.argv[1:]):
        print(usage(CONF))
        sys.exit(0)
    try:
        sys.argv[1:] = checkpoint_overrides(token_cap_overrides(system_overrides(sys.argv[1:])))
        check_group_choices(sys.argv[1:])
        check_override_keys(sys.argv[1:])
        os.environ[SWEPT_KEYS_VARIABLE] = ",".join(sorted(swept_keys(sys.argv[1:])))  # for a launcher's jobs
    except SpecterError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    main()
