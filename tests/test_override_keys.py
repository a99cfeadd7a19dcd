"""Unknown override keys: one line with the nearest known keys, before Hydra's several-line message."""
import subprocess
import sys

import pytest

from experiments.override_keys import check_override_keys
from specter.errors import SpecterError


@pytest.mark.parametrize("args, expected", [
    (["no_such_key=1"], "unknown option no_such_key= (known here: dataset, device"),
    (["experiment=batch", "batch_size=0"], "unknown option batch_size= (nearest known: experiment.batch_sizes;"),
    (["seeds=1"], "unknown option seeds= (nearest known: seed;"),
    (["specter.prefetc=false"], "unknown option specter.prefetc= (nearest known: prefetch"),
])
def test_an_unknown_key_is_one_line_with_the_nearest_known_keys(args, expected):
    with pytest.raises(SpecterError) as info:
        check_override_keys(args)
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)


def test_known_keys_group_choices_and_appended_keys_pass_the_key_check():
    check_override_keys(["model=dsv2", "mem=low", "k=4", "specter.prefetch=false", "model.layers=2", "+extra=1",
                         "++token_caps.mo_sm=2", "hydra.verbose=true", "k=1,2"])


def test_the_command_line_says_it_in_one_line_and_exits_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "experiments.main", "no_such_key=1"], capture_output=True, text=True,
                          cwd=tmp_path, env=None)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and done.stderr.startswith("error: unknown option")
