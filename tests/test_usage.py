"""`python -m experiments.main --help` states conf/config.yaml's defaults and whole descriptions."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from experiments.usage import describe, usage

CONF = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("system", "model", "mem", "experiment")


def option_line(text: str, name: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"  {name} "))


def test_the_defaults_in_the_help_are_config_yamls():
    config, text = OmegaConf.load(CONF / "config.yaml"), usage(CONF)
    assert f"default [{','.join(config.systems)}];" in option_line(text, "systems=[a,b,...]")
    assert "(default: [specter,target_only])" not in text
    assert (f"({config.num_prompts}) and repeats per prompt ({config.repeats})"
            in option_line(text, "num_prompts=N repeats=N"))
    assert f"({config.max_new_tokens})" in option_line(text, "max_new_tokens=N")
    chosen = {key: value for entry in config.defaults if not isinstance(entry, str) for key, value in entry.items()}
    assert f"(default: {chosen['model']})" in option_line(text, "model=NAME|DIR")
    assert f"(default: {chosen['mem']})" in option_line(text, "mem=high|low|gb")
    assert f"{chosen['dataset']} (default)" in option_line(text, "dataset=NAME")
    assert f"{chosen['experiment']} (default)" in option_line(text, "experiment=NAME")


def first_comment_paragraph(path: Path) -> list[str]:
    lines = [line for line in path.read_text().splitlines() if not line.startswith("# @")]
    start = next(i for i, line in enumerate(lines) if line.startswith("#"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("#")), len(lines))
    return [line.lstrip("#").strip() for line in lines[start:end]]


@pytest.mark.parametrize("path", [p for group in GROUPS for p in sorted((CONF / group).glob("*.yaml"))],
                         ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_each_description_is_the_whole_first_comment_paragraph(path):
    description = describe(path)
    assert description == " ".join(first_comment_paragraph(path))
    assert not re.search(r"(,|;|:|\b(and|or|the|a|of|per|vs|to))$", description), description


def test_the_help_shows_every_description_whole():
    flat = " ".join(usage(CONF).split())
    for group in GROUPS:
        for path in (CONF / group).glob("*.yaml"):
            assert describe(path) in flat, path
