"""Running the app under uvicorn: in the foreground (`python -m specter serve`) or on a thread (tests, benchmarks)."""
from __future__ import annotations

import errno
import logging
import socket
import sys
import threading
import time

import uvicorn

from specter.errors import SpecterError
from specter.serve.app import create_app

LOG_FORMAT = "%(levelname)s:     %(message)s"  # uvicorn's own look


def check_port(host: str, port: int) -> None:
    """One-line error when `host:port` cannot be listened on (in use, or not an address of this machine)."""
    if not 0 <= port <= 65535:
        raise SpecterError(f"--port must be in 0..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise SpecterError(f"--host {host}: not an address this machine can listen on ({err.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as err:
            why = "the port is in use (pick another with --port)" if err.errno == errno.EADDRINUSE else err.strerror
            raise SpecterError(f"cannot listen on {host}:{port}: {why}") from None


def log_to_stderr(log: logging.Logger) -> None:
    """The server's one line per request (and per error) on stderr."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def run_server(loader, host: str, port: int, max_batch: int = 16) -> None:
    """Serve until interrupted (Ctrl-C); the model loads in the background meanwhile. A load that fails stops the
    server and raises its error."""
    check_port(host, port)
    log = logging.getLogger("specter.serve")
    log_to_stderr(log)
    failed: list[BaseException] = []
    server: uvicorn.Server | None = None

    def stop_on_load_error(exc: BaseException) -> None:
        failed.append(exc)
        if server is not None:
            server.should_exit = True

    app = create_app(loader, max_batch=max_batch, on_load_error=stop_on_load_error,
                     log=log)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, access_log=False, log_level="info"))
    try:
        server.run()
    except SystemExit:  # uvicorn's own exit when it cannot start
        raise SpecterError(f"the server could not start on {host}:{port} (see the lines above)") from None
    if failed:
        exc = failed[0]
        raise exc if isinstance(exc, Exception) else SpecterError(f"loading stopped: {exc!r}")


class BackgroundServer:
    """The app under uvicorn on a daemon thread, on a free port of `host` (port 0) or the one given: `start()`
    returns once it listens (and, with `wait_ready`, once the model has loaded); `stop()` shuts it down."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app, self.host = app, host
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, access_log=False, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, name="specter-uvicorn", daemon=True)
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 120.0, wait_ready: bool = True) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.host}")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        state = self.app.state.specter
        while wait_ready and state.loaded is None:
            if state.error is not None:
                raise state.error
            if time.monotonic() > deadline:
                raise RuntimeError("the model did not load in time")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self if self.thread.ident is not None else self.start()  # started already: start(...) with options

    def __exit__(self, *exc) -> None:
        self.stop()
