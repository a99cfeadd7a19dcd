"""One-line errors for `key=value` overrides naming no option of the composed config (Hydra's own message is
several lines), with the nearest known keys."""
from __future__ import annotations

import difflib
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from specter.errors import SpecterError

CONF = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("model", "mem", "dataset", "experiment", "specter", "system", "hydra")


def check_override_keys(argv: list[str]) -> None:
    """Raise SpecterError for the first plain `a.b=value` override whose key the config (composed with argv's
    group choices) does not hold; `+`/`++`/`~` overrides and Hydra's own keys are left to Hydra."""
    overrides = [arg for arg in argv if "=" in arg and not arg.startswith(("+", "~", "-"))]
    keys = [arg.partition("=")[0] for arg in overrides]
    choices = [arg for arg, key in zip(overrides, keys) if key in GROUPS and "," not in arg and "(" not in arg]
    plain = [key for key in keys if not key.startswith(("hydra", "system")) and key not in GROUPS]
    if not plain:
        return
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=choices)
    for key in plain:
        missing = missing_part(cfg, key.split("."))
        if missing is not None:
            raise SpecterError(unknown_key_message(key, *missing, dotted_keys(cfg)))


def missing_part(cfg: DictConfig, parts: list[str]) -> tuple[str, list[str]] | None:
    """(the first part of a dotted key that `cfg` does not hold, the keys known at that level); None if it holds it."""
    node = cfg
    for part in parts:
        if not isinstance(node, DictConfig):
            return None  # below a leaf or a list: Hydra's own check applies
        if part not in node:
            return part, [str(k) for k in node.keys()]
        node = node[part]
    return None


def dotted_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Every key of `node` as `a.b.c`, nested configs included."""
    keys = []
    for key, value in node.items():
        keys.append(f"{prefix}{key}")
        if isinstance(value, DictConfig):
            keys += dotted_keys(value, f"{prefix}{key}.")
    return keys


def unknown_key_message(key: str, part: str, known: list[str], everywhere: list[str]) -> str:
    """The one line: the unknown key, and the known keys nearest to it at its level or, by their last part,
    anywhere in the config."""
    near = difflib.get_close_matches(part, known, n=3, cutoff=0.6)
    by_name = {k.rsplit(".", 1)[-1]: k for k in everywhere if k.rsplit(".", 1)[-1] not in near}
    near += [by_name[n] for n in difflib.get_close_matches(part, list(by_name), n=3, cutoff=0.7)]
    hint = f"nearest known: {', '.join(near)}" if near else f"known here: {', '.join(sorted(known))}"
    return f"unknown option {key}= ({hint}; python -m experiments.main --help lists the options)"
