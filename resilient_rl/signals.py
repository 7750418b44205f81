"""SIGTERM ends a command the way Ctrl-C does: its clean-up runs.

Without a handler Python dies at SIGTERM (sent by ``timeout``, a CI runner, ``kill``, a
container's stop) without running ``finally`` blocks: ``rrl chaos run`` then left its whole
platform running (etcd, the controllers, Ray and the job's workers, each in a session of its
own, so not reached by a signal to the harness's process group), and the job went on training.
With :func:`exit_on_sigterm` the first SIGTERM raises ``SystemExit(143)`` in the main thread, so
the harness stops what it started, and a second one during that clean-up is ignored (SIGKILL
still ends it at once). Standard library only: the CLI imports this before anything heavy.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

_received: list[int] = []


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    if _received:  # already stopping: let the clean-up finish
        return
    _received.append(signum)
    print("rrl: terminated (SIGTERM): cleaning up", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """Install the handler (see module doc); from the main thread only, as Python requires."""
    signal.signal(signal.SIGTERM, _on_sigterm)
