"""Fencing of worker calls by the leader's token (light: imported by every worker)."""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)

EXIT_SUPERSEDED = 75  # the exit status of a worker replaced while it was unreachable (see exit_superseded)


class StaleLeader(Exception):
    """A call from a controller that is no longer leader (a lower fencing token): refused."""


def check_fence(fence: int, token: int, what: str) -> None:
    """Refuse ``what`` when ``token`` is older than the newest leader token this worker has seen.

    Every leader passes its fencing token (the election's create_revision) with the
    calls that change state; a leader that adopts the worker raises ``fence``. A
    paused old leader that wakes up can still reach the worker before it notices it
    lost its lease; this check makes its calls no-ops, so no step is applied twice.
    """
    if token < fence:
        raise StaleLeader(f"{what}: leader token {token} is stale (worker follows token {fence})")


def exit_superseded(holder: dict[str, Any]) -> None:
    """A worker whose membership key another incarnation now holds was replaced while it could not
    answer (stopped, partitioned): nothing it does may land, so it leaves at once. Called from its
    registration's thread (``controller.membership.Registration(on_superseded=...)``)."""
    log.error(
        "replaced by pid %s on %s (incarnation %s) while this worker (pid %d) was unreachable: exiting",
        holder.get("pid"), holder.get("node"), holder.get("incarnation"), os.getpid(),
    )  # fmt: skip
    logging.shutdown()
    os._exit(EXIT_SUPERSEDED)
