"""The files workers capture their output into (``<workdir>/logs/<name>.<pid>.log``): their
format, listing and reading, for ``rrl logs`` and the controller's logs API. The capture
itself runs in the workers (``resilient_rl/workers/logcapture.py``). Light: no worker imports.

A line is ``<unix time, 6 decimals> <text>``; a file is rotated at :data:`MAX_BYTES` into
``.1`` .. ``.KEEP`` (oldest last).
"""

from __future__ import annotations

import heapq
import itertools
import re
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

MAX_BYTES = 8 << 20
KEEP = 2
_NAME = re.compile(r"^(?P<name>[a-z0-9-]+)\.(?P<pid>\d+)\.log(?:\.(?P<n>\d+))?$")


def file_name(name: str, pid: int) -> str:
    return f"{name}.{pid}.log"


@dataclass(frozen=True)
class LogFile:
    name: str  # "rollout-0", "trainer-spare-1"
    pid: int
    paths: tuple[Path, ...]  # oldest first: .2, .1, the live one


def list_files(folder: Path) -> list[LogFile]:
    """The captured logs under ``folder`` (``<workdir>/logs``), rotated parts grouped, by name then pid."""
    parts: dict[tuple[str, int], list[tuple[int, Path]]] = {}
    try:
        entries = list(folder.iterdir())
    except OSError:
        return []
    for p in entries:
        m = _NAME.match(p.name)
        if m:
            key = (m["name"], int(m["pid"]))
            parts.setdefault(key, []).append((int(m["n"] or 0), p))
    return [LogFile(name, pid, tuple(p for _, p in sorted(ps, key=lambda x: -x[0])))
            for (name, pid), ps in sorted(parts.items())]  # fmt: skip


def read_lines(path: Path, offset: int = 0) -> Iterator[tuple[float, str, int]]:
    """``(time, text, end offset)`` of each complete line of ``path`` from byte ``offset``."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            pos = offset
            for raw in f:
                if not raw.endswith(b"\n"):
                    return  # still being written
                pos += len(raw)
                stamp, _, text = raw[:-1].partition(b" ")
                try:
                    t = float(stamp)
                except ValueError:
                    continue
                yield t, text.decode("utf-8", "replace"), pos
    except OSError:
        return


@dataclass(frozen=True)
class Line:
    time: float
    source: str  # the file's name: "rollout-0", "trainer-spare-1"
    pid: int
    text: str


def select(files: Iterable[LogFile], group: str | None = None, worker: int | None = None) -> list[LogFile]:
    """The files of ``group`` (``rollout`` or ``trainer``, its spares included), or of its worker
    ``worker`` (every incarnation of that index, and a spare promoted to it from then on)."""
    out = []
    for f in files:
        if group is None:
            out.append(f)
        elif worker is None and (f.name == group or f.name.startswith(group + "-")):
            out.append(f)
        elif worker is not None and f.name == f"{group}-{worker}":
            out.append(f)
    return out


def _lines(f: LogFile) -> Iterator[Line]:
    for path in f.paths:
        for t, text, _ in read_lines(path):
            yield Line(t, f.name, f.pid, text)


def read(files: Iterable[LogFile], *, after: float | None = None, limit: int | None = None) -> list[Line]:
    """The lines of ``files`` merged in time order: with ``after`` (a time) the first ``limit``
    lines after it (a page: the next one starts after the last line's time), else the last
    ``limit`` lines (a tail)."""
    merged: Iterable[Line] = heapq.merge(*(_lines(f) for f in files), key=lambda x: x.time)
    if after is not None:
        return list(itertools.islice((x for x in merged if x.time > after), limit))
    return list(deque(merged, maxlen=limit))


class Follower:
    """New lines of a folder's files as they are written (``rrl logs -f``): remembers where it
    stopped in each file, picks up files that appear (a replacement worker) and rotations."""

    def __init__(self, folder: Path, group: str | None, worker: int | None, after: float) -> None:
        self.folder, self.group, self.worker, self.after = folder, group, worker, after
        self._offsets: dict[Path, int] = {}
        self._inodes: dict[Path, int] = {}

    def poll(self) -> list[Line]:
        out: list[Line] = []
        for f in select(list_files(self.folder), self.group, self.worker):
            live = f.paths[-1]
            try:
                ino = live.stat().st_ino
            except OSError:
                continue
            if self._inodes.get(live, ino) != ino:  # rotated: the rest of the old file is in .1
                rotated = Path(f"{live}.1")
                for t, text, _ in read_lines(rotated, self._offsets.get(live, 0)):
                    if t > self.after:
                        out.append(Line(t, f.name, f.pid, text))
                self._offsets[live] = 0
            self._inodes[live] = ino
            for t, text, end in read_lines(live, self._offsets.get(live, 0)):
                self._offsets[live] = end
                if t > self.after:
                    out.append(Line(t, f.name, f.pid, text))
        out.sort(key=lambda x: x.time)
        return out
