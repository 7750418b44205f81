"""A worker's own output in the job's workdir: ``<workdir>/logs/<name>.<pid>.log`` (``rrl logs``).

Every worker process (rollout worker, trainer rank, their spares) calls :func:`capture` first
thing: its file descriptors 1 and 2 become a pipe that a thread of its own drains into that
file, one timestamped line at a time, rotating at :data:`MAX_BYTES` (the newest
:data:`KEEP` older files kept as ``.1``, ``.2``), and passes on to where they went before
(Ray's per-worker files), so nothing Ray shows is lost. What the process and its children
write to either descriptor is caught: Python's prints and tracebacks, C libraries' messages,
the reward scorer processes' stderr. The workdir is the job's shared folder (the journal is
there too), so the controller and the CLI read the files wherever they run.

A line is ``<unix time, 6 decimals> <text>``; ``controller/worker_logs.py`` (the format's
other half, light: the controller and the CLI import it) lists and reads them back. A kill
loses at most what was in the pipe and not yet drained (a few milliseconds of output).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from controller.worker_logs import KEEP, MAX_BYTES, file_name

_RENAME = b"\x00rrl-log-rename\x00"  # a line in the pipe: the lines after it go to another file


class LogCapture:
    """This process's stdout and stderr, teed into a rotating file (see module doc)."""

    def __init__(self, folder: Path, name: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.name, self.pid = folder, name, os.getpid()
        self._last = 0.0  # the time of the last line written (strictly increasing, see _write)
        self._lock = threading.Lock()
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 - owned by the drain thread
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        self._orig = [os.dup(1), os.dup(2)]
        r, w = os.pipe()
        os.dup2(w, 1)
        os.dup2(w, 2)
        os.close(w)
        for stream in (sys.stdout, sys.stderr):
            reconfigure = getattr(stream, "reconfigure", None)
            if reconfigure is not None:
                try:
                    reconfigure(line_buffering=True)
                except (OSError, ValueError):
                    pass
        self._reader = os.fdopen(r, "rb", buffering=0)
        self._thread = threading.Thread(target=self._drain, name="log-capture", daemon=True)
        self._thread.start()

    @property
    def path(self) -> Path:
        return self.folder / file_name(self.name, self.pid)

    def rename(self, name: str) -> None:
        """From now on, write under ``name`` (a spare promoted to a worker's place). What was
        written before the call still goes to the old file: the switch travels through the
        pipe as a marker line, behind it."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        os.write(1, _RENAME + name.encode() + b"\n")

    def _switch(self, name: str) -> None:
        with self._lock:
            new = open(self.folder / file_name(name, self.pid), "ab", buffering=0)  # noqa: SIM115
            self._file.close()
            self.name, self._file = name, new

    def _drain(self) -> None:
        """Runs for the life of the process: a pipe nobody drains would block every write to
        fds 1 and 2 (this process's and its children's) once its buffer is full. So nothing
        here may end it but the pipe's end; a failure to write the file loses that output only."""
        partial = b""
        while True:
            try:
                chunk = self._reader.read(65536)
            except OSError:
                return
            if not chunk:
                return
            try:
                partial = self._take(partial + chunk)
            except Exception:  # noqa: BLE001 - see docstring
                partial = b""

    def _take(self, data: bytes) -> bytes:
        """Write the complete lines of ``data``; returns the unfinished rest."""
        lines = data.split(b"\n")
        partial = lines.pop()
        if len(partial) > 65536:  # a line without an end: written as it is
            lines.append(partial)
            partial = b""
        out: list[bytes] = []
        for line in lines:
            if line.startswith(_RENAME):
                self._write(out)
                out = []
                self._switch(line[len(_RENAME) :].decode())
            else:
                out.append(line)
        self._write(out)
        return partial

    def _write(self, lines: list[bytes]) -> None:
        if not lines:
            return
        try:  # where it went before (Ray's worker file)
            os.write(self._orig[0], b"".join(line + b"\n" for line in lines))
        except OSError:
            pass
        with self._lock:
            try:
                for line in lines:
                    # every line its own time, increasing: a reader's "after this time" cursor then
                    # never skips the rest of a chunk that was drained at once
                    self._last = max(time.time(), self._last + 1e-6)
                    record = f"{self._last:.6f} ".encode() + line + b"\n"
                    if self._file.tell() and self._file.tell() + len(record) > MAX_BYTES:
                        self._rotate()
                    self._file.write(record)
            except (OSError, ValueError):
                pass  # a full disk (or a file a failed rotation closed) must not take the worker down

    def _rotate(self) -> None:
        self._file.close()
        base = self.path
        try:
            for n in range(KEEP, 0, -1):
                src = base if n == 1 else Path(f"{base}.{n - 1}")
                if src.exists():
                    os.replace(src, f"{base}.{n}")
        finally:  # a failed rename leaves the file longer, never closed
            self._file = open(base, "ab", buffering=0)  # noqa: SIM115


_capture: LogCapture | None = None


def capture(workdir: str | os.PathLike[str], name: str) -> LogCapture | None:
    """Start capturing this process's output as ``name`` (once per process; later calls rename).
    Called first thing by every worker actor; returns the capture (its ``path`` goes into the
    worker's membership record). Only in a Ray actor's own process: a worker class built in
    another process (a test, a tool) must not take that process's stdout and stderr (None)."""
    global _capture
    if not _in_actor():
        return None
    if _capture is None:
        _capture = LogCapture(Path(workdir) / "logs", name)
    elif _capture.name != name:
        _capture.rename(name)
    return _capture


def _in_actor() -> bool:
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # noqa: BLE001 - no Ray, or no runtime context: not an actor
        return False
