"""Restore check for invariant 4: a fresh trainer group restores a committed snapshot and
replays the journal from there to the job's last step; its weights must equal the job's.

The journal replay from the initial weights (invariant 3) is :func:`resilient_rl.verify.replay_digest`;
this is the same replay started from a snapshot.
"""

from __future__ import annotations

from typing import Any

from ..verify import replay_digest


def restore_digest(spec: Any, snapshot: str, steps: int, ray_address: str | None, etcd: str) -> str:
    """Digest of the weights after restoring ``snapshot`` and training its step..steps-1.

    Raises whatever the restore raises (wrapped by Ray) if the snapshot cannot be loaded.
    """
    return replay_digest(spec, steps, ray_address, etcd, restore=snapshot)
