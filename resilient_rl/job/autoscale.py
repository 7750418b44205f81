"""The rollout autoscaler: grow or shrink the rollout group on queue backlog.

On when ``rollout.min_replicas < rollout.max_replicas``. The step loop reports,
every pass, how many shards wait for a worker and how many workers are idle:

* shards have been waiting with no idle worker for ``up_after`` seconds -> one
  more worker (up to ``max``);
* at least one worker has been idle with nothing queued for ``down_after``
  seconds -> one worker fewer (down to ``min``; the group drains it).

After each change it waits ``cooldown`` seconds (a new worker needs time to
start and join) before judging again. ``rrl scale --rollout N`` resets the size
it starts from. Pure logic, no Ray: the runner applies the size it returns.
Thread-safe: the runner's thread observes, the controller's thread resets (``rrl scale``).
"""

from __future__ import annotations

import threading


class Autoscaler:
    def __init__(
        self,
        lo: int,
        hi: int,
        size: int,
        *,
        up_after: float = 5.0,
        down_after: float = 30.0,
        cooldown: float = 20.0,
    ) -> None:
        if not 1 <= lo <= hi:
            raise ValueError(f"need 1 <= min ({lo}) <= max ({hi})")
        self.lo, self.hi = lo, hi
        self.size = min(hi, max(lo, size))
        self.up_after, self.down_after, self.cooldown = up_after, down_after, cooldown
        self._starved_since: float | None = None
        self._idle_since: float | None = None
        self._changed_at = float("-inf")
        self._lock = threading.Lock()

    def reset(self, size: int, now: float) -> None:
        """An operator set the size (``rrl scale``): start from it (clamped)."""
        with self._lock:
            self.size = min(self.hi, max(self.lo, size))
            self._starved_since = self._idle_since = None
            self._changed_at = now

    def observe(self, queued: int, idle: int, now: float) -> int:
        """One observation of the loop; returns the size the group should have."""
        with self._lock:
            return self._observe(queued, idle, now)

    def _observe(self, queued: int, idle: int, now: float) -> int:
        if now - self._changed_at < self.cooldown:  # the last change is still settling: judge afterwards
            self._starved_since = self._idle_since = None
            return self.size
        starved = queued > 0 and idle == 0
        spare = queued == 0 and idle > 0
        self._starved_since = (self._starved_since if self._starved_since is not None else now) if starved else None
        self._idle_since = (self._idle_since if self._idle_since is not None else now) if spare else None
        if self._starved_since is not None and now - self._starved_since >= self.up_after and self.size < self.hi:
            self.size += 1
            self._changed_at, self._starved_since = now, None
        elif self._idle_since is not None and now - self._idle_since >= self.down_after and self.size > self.lo:
            self.size -= 1
            self._changed_at, self._idle_since = now, None
        return self.size
