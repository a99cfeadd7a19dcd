"""A baseline's engine in a worker process of its own, spoken to in JSON lines (see workers/worker_loop.py)."""
from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

from specter.errors import SpecterError

EXCEPTION_LINE = re.compile(r"\b([A-Z]\w*(?:Error|Exception)): (.+)$")


class WorkerProcess:
    """A persistent worker (`command` runs a script on workers/worker_loop.py): JSON lines, each reply timed out.

    Its stderr goes to a log file, kept (and named in the error) once a request failed; the first
    exception there is the error's text. A worker that crashes (a signal, e.g. SIGSEGV) is one
    SpecterError line with its exit code, never a hang.
    """

    def __init__(self, command: list[str], name: str, startup_timeout_s: float, env: dict | None = None) -> None:
        self.name = name
        self.log_path = Path(tempfile.mkstemp(prefix=f"specter-{name.split()[0].lower()}-", suffix=".log")[1])
        env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, text=True, env=env, start_new_session=True)
        self.failed = False  # the log is kept (its path is in the error) once a request failed
        self.log_seen = 0  # errors are looked for in the log after what earlier replies covered
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.hello = self.request({"op": "hello"}, startup_timeout_s)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)  # end of output: the worker exited

    def request(self, message: dict, timeout_s: float) -> dict:
        op, log_offset = message["op"], self.log_seen
        try:
            if self.proc.poll() is not None:
                raise OSError("the worker is not running")
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            self.failed = True
            self.close(timeout_s=0)  # unresponsive: killed at once
            raise SpecterError(f"{self.name}: no reply to {op} within {timeout_s:g} s (log: {self.log_path})") from None
        except (OSError, ValueError):  # a closed or broken pipe
            line = None
        if line is None:
            self.failed = True
            raise SpecterError(f"{self.name} exited during {op} ({self.exit_status()}): "
                               f"{self.root_cause(log_offset) or 'no error in its log'} (log: {self.log_path})")
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            reply = {"ok": False, "error": f"not a reply: {line.strip()[:200]}"}
        self.log_seen = self.log_path.stat().st_size
        if not reply.get("ok"):
            self.failed = True
            raise SpecterError(f"{self.root_cause(log_offset) or reply.get('error')} (log: {self.log_path})")
        return reply

    def exit_status(self) -> str:
        """'code N' once the process is reaped (its output ends just before), with the signal that killed it."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        code = self.proc.poll()
        killed_by = f", {signal.Signals(-code).name}" if code is not None and code < 0 else ""
        return f"code {code}{killed_by}"

    def root_cause(self, offset: int = 0) -> str | None:
        """The first exception logged since `offset` (vLLM's engine processes log the root cause first)."""
        with open(self.log_path, errors="replace") as log:
            log.seek(offset)
            for line in log:
                match = EXCEPTION_LINE.search(line.strip())
                if match and "WARNING" not in line:
                    return f"{match.group(1)}: {match.group(2)}"[:300]
        return None

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask the worker to exit; its whole process group (e.g. vLLM's engine processes) is killed if it does not."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "close"}\n')
                self.proc.stdin.close()
                self.proc.wait(timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # engine processes left in the worker's own session
        if not self.failed:
            self.log_path.unlink(missing_ok=True)
