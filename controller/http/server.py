"""Run the HTTP app in a background thread of the controller process."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn


class HttpServer:
    """uvicorn serving ``app`` on ``host:port`` (port 0: any free port) in a daemon thread.

    The socket is bound in the constructor, so :attr:`url` is known (and a bad
    address raises ``OSError``) before the controller registers itself.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(128)
        self.host, self.port = host, int(self.sock.getsockname()[1])
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="http")  # fmt: skip

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        if host in ("0.0.0.0", "[::]"):
            host = socket.gethostname()
        return f"http://{host}:{self.port}"

    def start(self, wait: float = 10.0) -> HttpServer:
        self.thread.start()
        deadline = time.monotonic() + wait
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self.server.started:
            raise RuntimeError(f"HTTP server on {self.host}:{self.port} did not start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
        self.sock.close()
