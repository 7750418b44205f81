"""Fencing of worker calls by the leader's token (light: imported by every worker)."""

from __future__ import annotations


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
