"""The files of scripts/ and benchmarks/ as modules for the tests (neither folder is a package)."""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
BENCHMARKS = ROOT / "benchmarks"


def script_path(name: str) -> Path:
    """scripts/<name>.py or benchmarks/<name>.py, whichever exists."""
    for folder in (SCRIPTS, BENCHMARKS):
        if (folder / f"{name}.py").is_file():
            return folder / f"{name}.py"
    raise FileNotFoundError(f"no {name}.py in scripts/ or benchmarks/")


def load_script(name: str):
    """scripts/<name>.py or benchmarks/<name>.py executed as the module `name` (registered in sys.modules, as
    dataclasses need)."""
    spec = importlib.util.spec_from_file_location(name, script_path(name))
    module = sys.modules.setdefault(name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(module)
    return module
