"""A baseline's worker process: JSON-lines replies, prints kept out of them, failures and crashes as one line."""
import sys
from pathlib import Path

import pytest

from baselines.worker_process import WorkerProcess
from specter.errors import SpecterError

WORKERS = Path(__file__).resolve().parent.parent / "baselines" / "workers"
ECHO = f"""
import os, sys
sys.path.insert(0, {str(WORKERS)!r})
from worker_loop import replies_to_stdout, serve

def hello(request):
    print("chatter on stdout")  # must not land among the replies
    os.write(1, b"C-level chatter on fd 1\\n")
    return {{"pid": os.getpid()}}

def fail(request):
    raise ValueError("bad request: " + request["why"])

def crash(request):
    import signal
    os.kill(os.getpid(), signal.SIGSEGV)

with replies_to_stdout() as reply:
    serve({{"hello": hello, "fail": fail, "crash": crash, "echo": lambda r: {{"echo": r["x"]}}}}, reply)
"""


def echo_worker() -> WorkerProcess:
    return WorkerProcess([sys.executable, "-c", ECHO], "echo worker", startup_timeout_s=60)


def test_replies_stay_clean_of_prints_and_failures_are_one_line():
    worker = echo_worker()
    try:
        assert worker.hello["ok"] and worker.hello["pid"] > 0
        assert worker.request({"op": "echo", "x": [1, 2]}, 30)["echo"] == [1, 2]
        with pytest.raises(SpecterError, match="ValueError: bad request: because"):
            worker.request({"op": "fail", "why": "because"}, 30)
        with pytest.raises(SpecterError, match="unknown op 'nope'"):
            worker.request({"op": "nope"}, 30)
        assert "chatter on stdout" in worker.log_path.read_text()  # went to the log, not into a reply
    finally:
        worker.close()


def test_a_crashed_worker_is_an_error_with_its_exit_code():
    worker = echo_worker()
    try:
        with pytest.raises(SpecterError, match=r"echo worker exited during crash \(code -11, SIGSEGV\)"):
            worker.request({"op": "crash"}, 30)
        with pytest.raises(SpecterError, match=r"exited during echo \(code -11, SIGSEGV\)"):  # stays an error
            worker.request({"op": "echo", "x": 1}, 30)
    finally:
        worker.close()
