"""The request loop of a baseline's worker process (stdlib only: it runs in other environments too).

Protocol (baselines/worker_process.py speaks it): one JSON object per line on stdin, one reply per line
on stdout; everything else that would go to stdout (the engine's own prints, also from C) goes to
stderr. {"op": NAME, ...} calls ops[NAME](request); {"op": "close"} or the end of input exits. Every
reply has "ok"; a failure is {"ok": false, "error": "<one line>"} with the traceback on stderr.
"""
from __future__ import annotations

import json
import os
import sys
import traceback


def handle(ops: dict, request: dict) -> dict:
    op = request.get("op")
    if op not in ops:
        return {"ok": False, "error": f"unknown op {op!r}"}
    try:
        return {"ok": True, **ops[op](request)}
    except Exception as exc:  # noqa: BLE001 -- any failure is a reply; the adapter makes it one SpecterError line
        traceback.print_exc(file=sys.stderr)
        return {"ok": False, "error": f"{type(exc).__name__}: {' '.join(str(exc).split())}"}


def serve(ops: dict, reply) -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        if request.get("op") == "close":
            break
        reply.write(json.dumps(handle(ops, request)) + "\n")
        reply.flush()


def replies_to_stdout():
    """A file for the replies on the real stdout; file descriptor 1 then points at stderr, so nothing
    else (Python or C) printed to stdout can land among the replies."""
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return reply
