"""Repository contracts: SHA256SUMS is current, CI runs the README's commands, every module says its job."""
import ast
import hashlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_sha256sums_is_current():
    listed = {}
    for line in (ROOT / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        listed[name.lstrip("*")] = digest
    shipped = {str(p.relative_to(ROOT)) for p in (ROOT / "conf").rglob("*.yaml")}
    shipped |= {str(p.relative_to(ROOT)) for p in (ROOT / "initialization").glob("*.json")}
    assert set(listed) == shipped, "run scripts/update_checksums.sh"
    for name, digest in listed.items():
        assert hashlib.sha256((ROOT / name).read_bytes()).hexdigest() == digest, name


def test_ci_runs_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    commands = [line for line in (ROOT / ".ci/run").read_text().splitlines()
                if line.startswith("python3 -m pip install -q -e")]
    assert len(commands) == 2
    for command in commands:
        assert command in readme


def test_every_module_has_a_docstring():
    for package in ("specter", "baselines", "experiments"):
        for path in (ROOT / package).rglob("*.py"):
            if path.name == "__init__.py" and not path.read_text().strip():
                continue
            assert ast.get_docstring(ast.parse(path.read_text())), path


def test_only_experiments_import_hydra():
    for package in ("specter", "baselines"):
        for path in (ROOT / package).rglob("*.py"):
            assert "hydra" not in path.read_text(), path
