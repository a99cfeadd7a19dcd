"""The harness's command line, in process: composed configs and the one-line errors the command line stops with."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from experiments.main import check_group_choices, checkpoint_overrides, run, system_overrides, token_cap_overrides
from specter.errors import SpecterError

CONF = Path(__file__).resolve().parent.parent / "conf"


def compose_with(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def cli_error(tmp_path: Path, monkeypatch, *args: str) -> str:
    """The SpecterError that `python -m experiments.main ARGS`, run from `tmp_path`, stops with: its checks
    before Hydra, then `run` on the composed config. The command line prints it as one `error:` line and
    exits with 2 (tests/test_main.py::test_the_command_line_prints_one_line_and_exits_2 runs that for real)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecterError) as info:
        overrides = checkpoint_overrides(token_cap_overrides(system_overrides(list(args))))
        check_group_choices(overrides)
        run(compose_with(*overrides))
    return str(info.value)
