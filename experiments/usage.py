"""The text of `python -m experiments.main --help`: the choices of each config group and the common options."""
from __future__ import annotations

from pathlib import Path

COMMON_OPTIONS = (  # the ten most used options, one line each
    ("model=NAME|DIR", "a conf/model option or a Hugging Face checkpoint directory (default: tiny)"),
    ("mem=high|low|gb", "the memory budget: the model's preset, or mem=gb mem.gb=40 (GB of GPU memory)"),
    ("systems=[a,b,...]", "the systems compared (default: [specter,target_only]); system=X runs X alone"),
    ("dataset=NAME", "the prompts: builtin (default), gsm8k, wikitext2, humaneval, gpqa, c4, all"),
    ("experiment=NAME", "what to measure: main (default), depth, prefix, routing, kernel, batch"),
    ("k=N|auto", "speculation depth (default: the model's; auto: the depth experiment's best)"),
    ("num_prompts=N repeats=N", "prompts per dataset (5) and repeats per prompt (3)"),
    ("max_new_tokens=N", "tokens decoded per case (128)"),
    ("device=cpu|cuda dtype=...", "where and in what dtype (default: CUDA if present; bfloat16 there, float32 on CPU)"),
    ("results_dir=DIR resume=true", "where results go (never overwritten); resume continues a cut run"),
)


def describe(path: Path) -> str:
    """The first comment line of a config file (not a `# @package` directive), without its `#`."""
    for line in path.read_text().splitlines():
        if line.startswith("#") and not line.startswith("# @"):
            return line.lstrip("# ").strip()
    return ""


def group_lines(conf: Path, group: str, title: str) -> list[str]:
    """`title:` then one line per option file of conf/<group>/: its name and its description."""
    files = sorted((conf / group).glob("*.yaml"))
    width = max((len(f.stem) for f in files), default=0)
    return [f"{title}:"] + [f"  {f.stem:<{width}}  {describe(f)}" for f in files]


def usage(conf: Path) -> str:
    """The whole help text."""
    width = max(len(name) for name, _ in COMMON_OPTIONS)
    lines = ["usage: python -m experiments.main [key=value ...]     (Hydra overrides; -m key=a,b for a sweep)",
             "", "Runs an experiment and writes records.csv, summary.csv and run.json under results/.", ""]
    for group, title in (("system", "systems (system=X, or systems=[a,b,...])"), ("model", "models (model=)"),
                         ("mem", "memory (mem=)"), ("experiment", "experiments (experiment=)")):
        lines += group_lines(conf, group, title) + [""]
    lines += ["common options:"] + [f"  {name:<{width}}  {text}" for name, text in COMMON_OPTIONS]
    lines += ["", "Specter's own options: specter.<field>=value (conf/specter/default.yaml lists them)."]
    return "\n".join(lines)
