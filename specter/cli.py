"""Command-line entry points: every error is one line and an exit code (SPECTER_DEBUG=1 shows tracebacks)."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable

from specter.errors import SpecterError, first_line


def run_cli(run: Callable[[], int | None], codes: tuple = ((SpecterError, 2),), other: int = 2,
            interrupted: str = "") -> int:
    """Call `run`; map exceptions to one `error: ...` line on stderr and an exit code.

    codes: (exception type, exit code) pairs, most specific first; other: the code for anything else.
    """
    try:
        return run() or 0
    except KeyboardInterrupt:
        print(f"error: interrupted{interrupted}", file=sys.stderr)
        return 130
    except Exception as exc:
        for kind, code in codes:
            if isinstance(exc, kind):
                print(f"error: {exc}", file=sys.stderr)
                return code
        if os.environ.get("SPECTER_DEBUG"):
            raise
        print(f"error: {type(exc).__name__}: {first_line(exc)}", file=sys.stderr)
        return other
