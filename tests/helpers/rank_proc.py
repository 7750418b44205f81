"""A :class:`~resilient_rl.workers.trainer.TrainerRank` in a process of its own, driven by
method calls over a pipe (no Ray): what the hot-recovery tests need to SIGKILL one rank of
a real gloo group and re-form it. Calls are asynchronous (``send`` then ``result``) so that
the ranks of a collective can be called together. Processes are the test's children,
killed by handle."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import traceback
from typing import Any

from resilient_rl.workers.local_group import trainer_env


def _serve(conn: Any, args: tuple[Any, ...]) -> None:
    from resilient_rl.workers.trainer import TrainerRank

    rank = TrainerRank(*args)
    while True:
        try:
            method, a, k = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", getattr(rank, method)(*a, **k)))
        except BaseException as e:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class RankProc:
    def __init__(self, *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, args), daemon=True)
        with trainer_env():  # as the job's ranks start
            self.proc.start()
        self.pid = self.proc.pid

    def send(self, method: str, *args: Any, **kwargs: Any) -> RankProc:
        self.conn.send((method, args, kwargs))
        return self

    def result(self, timeout: float = 120) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"rank process {self.pid}: no answer within {timeout}s")
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(value)
        return value

    def error(self, timeout: float = 120) -> str:
        """The error the pending call ended with (fails if it succeeded)."""
        if not self.conn.poll(timeout):
            raise TimeoutError(f"rank process {self.pid}: no answer within {timeout}s")
        status, value = self.conn.recv()
        assert status == "error", f"expected the call to fail, it returned {value!r}"
        return str(value)

    def call(self, method: str, *args: Any, timeout: float = 120, **kwargs: Any) -> Any:
        return self.send(method, *args, **kwargs).result(timeout)

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        self.kill()
        self.conn.close()


def call_all(ranks: list[RankProc], method: str, *args: Any, timeout: float = 120) -> list[Any]:
    """``method`` on every rank at once (a collective); the answers in rank order."""
    for r in ranks:
        r.send(method, *args)
    return [r.result(timeout) for r in ranks]
