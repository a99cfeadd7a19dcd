"""The text of `python -m experiments.main --help`: the choices of each config group and the common options."""
from __future__ import annotations

import textwrap
from pathlib import Path

from omegaconf import OmegaConf

WIDTH = 120  # the help's lines wrap here


def common_options(conf: Path) -> tuple[tuple[str, str], ...]:
    """The ten most used options, one line each; the defaults they state are conf/config.yaml's."""
    config, chosen = defaults(conf)
    systems = "[" + ",".join(config["systems"]) + "]"
    return (
        ("model=NAME|DIR", f"a conf/model option or a Hugging Face checkpoint directory (default: {chosen['model']})"),
        ("mem=high|low|gb",
         f"the memory budget: the model's preset (default: {chosen['mem']}), or GPU GB: mem=gb mem.gb=40"),
        ("systems=[a,b,...]", f"the systems compared, default {systems}; system=X runs X alone"),
        ("dataset=NAME", f"the prompts: {choices(conf, 'dataset', chosen['dataset'])}"),
        ("experiment=NAME", f"what to measure: {choices(conf, 'experiment', chosen['experiment'])}"),
        ("k=N|auto", "speculation depth (default: the model's; auto: the depth experiment's best)"),
        ("num_prompts=N repeats=N",
         f"prompts per dataset ({config['num_prompts']}) and repeats per prompt ({config['repeats']})"),
        ("max_new_tokens=N", f"tokens decoded per case ({config['max_new_tokens']})"),
        ("device=cpu|cuda dtype=...", "where and in what dtype (default: CUDA if present; bfloat16 there, float32 on CPU)"),
        ("results_dir=DIR resume=true", "where results go (never overwritten); resume continues a cut run"),
    )


def defaults(conf: Path) -> tuple[dict, dict]:
    """conf/config.yaml's settings, and its defaults list's group choices ({"model": "tiny", ...})."""
    config = OmegaConf.to_container(OmegaConf.load(conf / "config.yaml"))
    chosen = {key: value for entry in config["defaults"] if isinstance(entry, dict) for key, value in entry.items()}
    return config, chosen


def choices(conf: Path, group: str, default: str) -> str:
    """`default (default), other, ...`: the option files of conf/<group>/, the default first."""
    others = sorted(f.stem for f in (conf / group).glob("*.yaml") if f.stem != default)
    return ", ".join([f"{default} (default)", *others])


def describe(path: Path) -> str:
    """The first comment paragraph of a config file (its consecutive `#` lines, not a `# @package` directive),
    joined into one line without the `#`s."""
    lines: list[str] = []
    for line in path.read_text().splitlines():
        if line.startswith("#") and not line.startswith("# @"):
            lines.append(line.lstrip("#").strip())
        elif lines:
            break
    return " ".join(line for line in lines if line)


def group_lines(conf: Path, group: str, title: str) -> list[str]:
    """`title:` then each option file of conf/<group>/: its name and its description, wrapped under itself."""
    files = sorted((conf / group).glob("*.yaml"))
    width = max((len(f.stem) for f in files), default=0)
    lines = [f"{title}:"]
    for f in files:
        wrapped = textwrap.wrap(describe(f), WIDTH - width - 4, break_on_hyphens=False) or [""]
        lines += [f"  {f.stem:<{width}}  {wrapped[0]}"] + [" " * (width + 4) + more for more in wrapped[1:]]
    return lines


def usage(conf: Path) -> str:
    """The whole help text."""
    options = common_options(conf)
    width = max(len(name) for name, _ in options)
    lines = ["usage: python -m experiments.main [key=value ...]     (Hydra overrides; -m key=a,b for a sweep)",
             "", "Runs an experiment and writes records.csv, summary.csv and run.json under results/.", ""]
    for group, title in (("system", "systems (system=X, or systems=[a,b,...])"), ("model", "models (model=)"),
                         ("mem", "memory (mem=)"), ("experiment", "experiments (experiment=)")):
        lines += group_lines(conf, group, title) + [""]
    lines += ["common options:"] + [f"  {name:<{width}}  {text}" for name, text in options]
    lines += ["", "Specter's own options: specter.<field>=value (conf/specter/default.yaml lists them)."]
    return "\n".join(lines)
