"""Fencing of worker calls by the leader's token (light: imported by every worker)."""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)

EXIT_SUPERSEDED = 75  # the exit status of a worker replaced while it was unreachable (see exit_superseded)
EXIT_STALE_POLICY = 76  # a rollout worker that could not load the policy it was sent (see exit_stale_policy)


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


def exit_stale_policy(have: int, step: int) -> None:
    """A rollout worker asked for a shard of ``step`` holds policy ``have``, older than the
    staleness bound allows: a ``load_weights`` it was sent failed (the handle's owner died with
    a lost node or trainer rank, ...). The shard would fail the job at training; the worker
    exits instead, so the driver generates the shard again on a replacement, which loads the
    driver's current weights."""
    log.error("asked for a shard of step %d holding policy v%d (a weight load failed): exiting", step, have)
    logging.shutdown()
    os._exit(EXIT_STALE_POLICY)
