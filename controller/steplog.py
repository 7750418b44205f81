"""The per-step metrics log of a job (``<workdir>/metrics.jsonl``): one JSON line per step.

The leader appends step k's line *before* the fenced compare-and-swap that commits
k (:func:`append`), so a leader killed between the two cannot lose the line of a
step that etcd committed. The price is that a line may exist for a step that was
then not committed, or be written twice (a new leader commits the step again);
so every reader goes through :func:`read`: the first line of each step is kept,
steps at or past the committed step are dropped when it is known, and a torn last
line (the writer was killed mid-line) is skipped. The first lines are in commit
order: whoever writes step k+1's line has committed k, after writing a line of k.
(A later copy may not be: a deposed runner can wake between its line and its
refused commit. Copies hold the same figures, as training is deterministic.)

Light module (no heavy imports): the controller's page, the chaos harness and the
benchmarks read it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def append(path: str | Path, record: dict[str, Any]) -> None:
    """Append ``record`` (it must carry an integer ``step``) as one line, flushed to disk."""
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)  # one write of the whole line with O_APPEND: never interleaved
        os.fsync(fd)
    finally:
        os.close(fd)


def parse(lines: list[bytes] | list[str], committed: int | None = None) -> list[dict[str, Any]]:
    """Rows from raw lines: the first line of each step, in file order, only steps below
    ``committed`` when given; unparsable lines are skipped."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in lines:
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (ValueError, KeyError, TypeError):
            continue
        if committed is not None and step >= committed:
            continue
        by_step.setdefault(step, row)
    return list(by_step.values())


def read(path: str | Path, committed: int | None = None) -> list[dict[str, Any]]:
    """The rows of the log at ``path`` (see :func:`parse`); [] if it cannot be read."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return []
    return parse(data.splitlines(), committed)
