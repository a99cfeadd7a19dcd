"""Triton interpreter handling shared by the kernel tests: import this before anything imports triton.

Triton's interpreter mode is process-wide: TRITON_INTERPRET is read whenever @triton.jit decorates a
function, i.e. when triton imports its own language library and when a kernel module is imported (not
at launch). Setting it after `import triton` gives a half-interpreted triton that fails at the first
launch. So: on a machine without CUDA, set it here, before anything imports triton, and leave it set
(nothing can run compiled there anyway). With CUDA, or if triton is already imported in compiled mode
(transformers/torch._dynamo import it when a model loads), keep this process compiled for the GPU
classes and run the CPU cases in a subprocess with the flag set.
"""
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" or (
    "triton" not in sys.modules and not torch.cuda.is_available())
if INTERPRETED:
    os.environ["TRITON_INTERPRET"] = "1"

ROOT = Path(__file__).resolve().parent.parent
interpreted = pytest.mark.skipif(not INTERPRETED, reason="compiled-mode process: covered by the subprocess test")


def run_interpreter_cases(test_file: str, request: pytest.FixtureRequest) -> None:
    """In a compiled-mode process, run `test_file`'s CPU cases in a fresh interpreter-mode process: one
    process for every kernel test file this session collected (each pays the imports once), failures
    reported by the file they belong to."""
    if INTERPRETED:
        pytest.skip("this process runs the interpreter cases itself")
    files = sorted({str(item.path) for item in request.session.items
                    if item.originalname == "test_interpreter_cases_in_subprocess"} | {str(Path(test_file))})
    run = interpreter_run(tuple(files))
    relative = str(Path(test_file).resolve().relative_to(ROOT))
    failed = [line for line in run.stdout.splitlines() if line.startswith(("FAILED ", "ERROR ")) and relative in line]
    assert not failed and run.returncode in (0, 1), "\n".join(failed) + "\n" + run.stdout[-4000:] + run.stderr[-2000:]


@functools.lru_cache(maxsize=None)
def interpreter_run(files: tuple[str, ...]) -> subprocess.CompletedProcess:
    """`files`' cases without the gpu marker, in one pytest process with TRITON_INTERPRET=1 and no CUDA."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-m", "not gpu", *files]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
