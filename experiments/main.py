"""Entry point of every experiment: compose the config, run it, write records/summary/run.json, print a table.

    python -m experiments.main                                  # tiny default on CPU (main comparison)
    python -m experiments.main model=dsv2 mem=low dataset=all   # the paper's protocol on a checkpoint
    python -m experiments.main experiment=depth                 # also: prefix, routing, kernel
"""
from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from experiments import records
from experiments.experiments import EXPERIMENTS
from experiments.settings import results_dir, write_run_json
from specter.errors import SpecterError

CONF = Path(__file__).resolve().parent.parent / "conf"
CHECKED_GROUPS = ("model", "mem", "dataset", "experiment")


def check_group_choices(argv: list[str]) -> None:
    """One-line error for `group=option` overrides naming an option file that does not exist."""
    for arg in argv:
        group, sep, option = arg.partition("=")
        if sep and group in CHECKED_GROUPS and (CONF / group).is_dir() and not (CONF / group / f"{option}.yaml").is_file():
            known = ", ".join(sorted(p.stem for p in (CONF / group).glob("*.yaml")))
            raise SpecterError(f"unknown {group} {option!r}; known: {known}")


def run(cfg: DictConfig) -> Path:
    """Run the configured experiment; returns the results directory it wrote."""
    out_dir, resumed = results_dir(cfg)
    opened: list[records.RecordWriter] = []

    def open_writer() -> records.RecordWriter:
        """Create the results directory only once the inputs are valid and the model is loaded."""
        out_dir.mkdir(parents=True, exist_ok=resumed)
        write_run_json(out_dir, cfg, complete=False)
        opened.append(records.RecordWriter(out_dir, resume=resumed))
        return opened[0]

    header, by = EXPERIMENTS[cfg.experiment.name](cfg, out_dir, open_writer)
    summary = records.write_summary(out_dir, opened[0].rows, by)
    write_run_json(out_dir, cfg, complete=True)
    print(f"\n{header}")
    print(records.format_table(summary))
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
    try:
        check_group_choices(sys.argv[1:])
    except SpecterError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    main()
