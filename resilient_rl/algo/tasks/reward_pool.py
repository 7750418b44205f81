"""User reward functions in killable child processes, each call under a deadline.

A user's ``task.reward_fn`` may hang (a deadlock, a network call, a regex that
backtracks for ever). A Python thread cannot be killed and ``signal.alarm`` works
only in the main thread and cannot interrupt C code, so the function runs in a
few child processes of the rollout worker; a call that misses its deadline scores
0 with an error naming the function, its process is killed (its whole process
group) and replaced, and the shard goes on. A child that dies mid-call is the
same: that sample scores 0, a new child takes the next call.

The children are plain ``python -m resilient_rl.algo.tasks.reward_pool REF``
processes (not ``multiprocessing``, whose spawn re-imports the Ray worker's main
module and whose fork copies an engine's threads). They speak JSON lines on a
private pipe; the user function's own prints go to stderr. Every later user
scorer (a reward server client, a math verifier) runs through the same pool.

Runs inside the rollout worker; imports nothing heavy.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from resilient_rl.algo.tasks.base import RewardResult, TaskError
from resilient_rl.algo.tasks.reward_server import ServerScorer
from resilient_rl.algo.tasks.rewards import call_reward_fn, load_reward_fn

if TYPE_CHECKING:
    from resilient_rl.spec import RewardServerSpec

_START_TIMEOUT_S = 60.0
_SERVER = "server="  # a ref that is a reward server's configuration (JSON), not a function  # importing the user's module (it may import torch, a tokenizer...)


@dataclass
class _Child:
    proc: subprocess.Popen[bytes]
    replies: IO[bytes]
    started: float
    ready: bool = False  # its "ready" line arrived: the user's module is imported
    buf: bytes = b""
    busy: tuple[list[int], float] | None = None  # (the indices of the calls it scores, deadline)

    def line(self) -> bytes | None:
        """One complete reply line from what was read so far, if any."""
        if b"\n" not in self.buf:
            return None
        line, _, self.buf = self.buf.partition(b"\n")
        return line


class RewardPool:
    """``size`` child processes scoring ``ref`` (``module:function``, or a reward server: see
    :meth:`for_server`) with ``timeout_s`` per call of at most ``batch`` samples.

    ``score(calls)`` returns one :class:`RewardResult` per ``(prompt, completion, answer)``, in order; it
    never raises for a user function's failure. The constructor raises :class:`TaskError` when the function
    cannot be imported in a child (as ``make_task`` does in-process). A replacement child starts in the
    background: a call sent to it before it is ready gets its deadline from the moment it is. Not
    thread-safe: one caller.
    """

    def __init__(self, ref: str, timeout_s: float, size: int = 2, batch: int = 1) -> None:
        self.ref, self.timeout_s, self.size, self.batch = ref, timeout_s, size, batch
        if ref.startswith(_SERVER):
            self.what, self.hint = (
                f"reward server {json.loads(ref[len(_SERVER) :])['url']}",
                "task.reward_server: timeout_s per try, retries + 1 tries, their backoffs",
            )
        else:
            self.what, self.hint = f"reward function {ref}", "task.reward_timeout_s"
        self.restarts = 0  # children killed (timeout) or lost (crash) and replaced
        self._children: list[_Child] = []
        try:
            for _ in range(size):
                self._children.append(self._spawn())
            for c in self._children:  # the first ones are waited for: a bad reference fails here
                self._await_ready(c)
        except BaseException:
            self.close()
            raise

    @classmethod
    def for_server(cls, rs: RewardServerSpec, size: int) -> RewardPool:
        """A pool whose children post batches of ``rs.batch_size`` samples to a reward server (see
        ``reward_server``), each batch cut at the longest its tries may take."""
        config = json.dumps({"url": rs.url, "timeout_s": rs.timeout_s, "retries": rs.retries})
        return cls(_SERVER + config, rs.batch_deadline_s(), size, rs.batch_size)

    # -- the parent side ---------------------------------------------------------

    def _spawn(self) -> _Child:
        r, w = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "resilient_rl.algo.tasks.reward_pool", self.ref, str(w)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,  # the child writes replies on fd w; its prints go to stderr
            pass_fds=(w,),
            env=env,
            start_new_session=True,  # its own process group: a kill takes what it started too
        )
        os.close(w)
        return _Child(proc, os.fdopen(r, "rb", buffering=0), time.monotonic())

    def _await_ready(self, child: _Child) -> None:
        deadline = child.started + _START_TIMEOUT_S
        while not child.ready:
            line = child.line()
            if line is None:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([child.replies], [], [], left)[0] or not self._read(child):
                    raise TaskError(f"{self.what} did not load within {_START_TIMEOUT_S:g}s")
                continue
            self._hello(child, line)

    def _hello(self, child: _Child, line: bytes) -> None:
        msg = json.loads(line)
        if "error" in msg:
            raise TaskError(msg["error"])
        child.ready = True
        if child.busy is not None:  # a call sent while it was loading: its time starts now
            child.busy = (child.busy[0], time.monotonic() + self.timeout_s)

    @staticmethod
    def _read(child: _Child) -> bool:
        chunk = child.replies.read(65536)
        child.buf += chunk or b""
        return bool(chunk)

    def _kill(self, child: _Child) -> None:
        try:
            os.killpg(child.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        child.proc.wait(timeout=10)
        child.replies.close()
        if child.proc.stdin is not None:
            child.proc.stdin.close()

    def _replace(self, i: int) -> None:
        self._kill(self._children[i])
        self.restarts += 1
        self._children[i] = self._spawn()  # not waited for: it loads while the others work

    def _deadline(self, child: _Child) -> float:
        if child.ready:
            return time.monotonic() + self.timeout_s
        return child.started + _START_TIMEOUT_S + self.timeout_s  # reset once it is ready

    def score(
        self, calls: list[tuple[str, str, str]], progress: Callable[[], None] | None = None
    ) -> list[RewardResult]:
        """Score every call (see class doc). ``progress`` is called each time a child's call ends (scored,
        timed out or its child lost): the rollout worker stamps its membership with it, so that a
        shard slowed by timing-out calls and their children's restarts reads as slow, not hung."""
        results: list[RewardResult | None] = [None] * len(calls)
        todo = list(range(len(calls)))[::-1]  # popped from the end: in order
        while todo or any(c.busy for c in self._children):
            for c in self._children:  # hand out work
                if c.busy is None and todo:
                    js = [todo.pop() for _ in range(min(self.batch, len(todo)))]
                    try:
                        assert c.proc.stdin is not None
                        c.proc.stdin.write(json.dumps([calls[j] for j in js]).encode() + b"\n")
                        c.proc.stdin.flush()
                    except (BrokenPipeError, OSError):
                        pass  # it died; the read below sees EOF and replaces it
                    c.busy = (js, self._deadline(c))
            busy = [c for c in self._children if c.busy]
            nearest = min(c.busy[1] for c in busy if c.busy)
            ready = select.select([c.replies for c in busy], [], [], max(0.0, nearest - time.monotonic()))[0]
            for i, c in enumerate(self._children):
                if c.busy is None:
                    continue
                js = c.busy[0]
                error = None
                if c.replies in ready:
                    if not self._read(c):  # EOF: it died (its exit status follows at once)
                        try:
                            code: int | None = c.proc.wait(timeout=5)
                        except subprocess.TimeoutExpired:
                            code = None
                        error = f"ChildProcessError: {self.what} died (exit code {code})"
                    while error is None and (line := c.line()) is not None:
                        if not c.ready:
                            self._hello(c, line)
                            continue
                        msg: dict[str, Any] = json.loads(line)
                        for j, v, err in zip(js, msg["values"], msg["errors"], strict=True):
                            results[j] = RewardResult(float(v), err)
                        c.busy = None
                        if progress is not None:
                            progress()
                        break
                    if error is None:
                        continue
                elif time.monotonic() >= c.busy[1]:
                    error = (
                        f"TimeoutError: {self.what} did not return within {self.timeout_s:g}s "
                        f"({self.hint}); its process was killed"
                    )
                else:
                    continue
                for j in js:
                    results[j] = RewardResult(0.0, error)
                c.busy = None
                self._replace(i)
                if progress is not None:
                    progress()
        return [r if r is not None else RewardResult(0.0, "lost") for r in results]

    def close(self) -> None:
        for c in self._children:
            self._kill(c)
        self._children = []


# -- the child side ------------------------------------------------------------------


def _scorer(ref: str) -> Callable[[list[tuple[str, str, str]]], list[RewardResult]]:
    """What a child scores batches with: a reward server's client, or the user's function
    (raises TaskError when it cannot be imported)."""
    if ref.startswith(_SERVER):
        return ServerScorer.from_config(ref[len(_SERVER) :]).score
    fn = load_reward_fn(ref)
    raised = 0

    def show(e: Exception) -> None:  # the worker's log has the traceback (`rrl logs JOB --group rollout`)
        nonlocal raised
        raised += 1
        if raised <= 3 or raised % 100 == 0:
            print(f"reward function {ref} raised (call {raised} of this scorer process):", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)

    return lambda calls: [call_reward_fn(fn, p, c, a, on_error=show) for p, c, a in calls]


def _serve(ref: str, fd: int) -> None:
    replies = os.fdopen(fd, "w", buffering=1)
    os.dup2(2, 1)  # the user function's prints must not reach the reply pipe
    try:
        score = _scorer(ref)
    except TaskError as e:
        replies.write(json.dumps({"error": str(e)}) + "\n")
        return
    replies.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        results = score([tuple(x) for x in json.loads(line)])  # type: ignore[misc]
        replies.write(json.dumps({"values": [r.value for r in results], "errors": [r.error for r in results]}) + "\n")


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]))
