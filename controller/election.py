"""Leader election and fenced writes.

One key, ``/rrl/v1/leader``, holds the leader's id on the leader's lease. A
candidate wins by creating it (txn: create_revision == 0). The key's
create_revision is the leader's *fencing token*: every leader write is a txn
that also compares the leader key's create_revision with the token, so a stale
leader (paused past its TTL, partitioned) cannot write once somebody else has
won, whatever it believes.

Locally a leader also stops acting before its lease can have run out: it trusts
its leadership only until ``lease.valid_until() - margin`` (monotonic time of
the last successful refresh *send* plus the TTL etcd granted, minus a safety
margin), so it steps down before another candidate can win.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from . import keys
from .store import Compare, Delete, EtcdError, Get, Op, Put, Store, TxnResult
from .watch import KeptLease

log = logging.getLogger(__name__)


class NotLeader(Exception):
    """A leader-only write was attempted by a controller that is not (or no longer) the leader."""


class Election:
    """Campaign for leadership under ``/rrl/v1/leader``.

    ``campaign()`` blocks until this candidate leads (or ``stop()``);
    ``is_leader`` is true only while the lease is certainly valid;
    ``fenced_txn()`` is the one way a leader writes.
    """

    def __init__(self, store: Store, candidate_id: str, *, ttl: int = 5, margin: float | None = None) -> None:
        self.store = store
        self.id = keys.check_name(candidate_id, "controller id")
        self.ttl = ttl
        self.margin = margin if margin is not None else max(0.5, ttl / 5.0)
        self.key = keys.leader()
        self.token = 0  # create_revision of our leader key while we lead
        self.lease: KeptLease | None = None
        self._stop = threading.Event()
        self._lost = threading.Event()

    # -- state -----------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        lease = self.lease
        return (
            self.token > 0
            and lease is not None
            and not self._lost.is_set()
            and time.monotonic() < lease.valid_until() - self.margin
        )

    def leader(self) -> str | None:
        """Id of the current leader as etcd sees it (None if there is none)."""
        kv = self.store.get(self.key)
        return kv.value.decode() if kv else None

    # -- campaign ------------------------------------------------------------

    def try_acquire(self) -> bool:
        """One attempt to become leader. True if we lead now."""
        if self.is_leader:
            return True
        self._release_local()
        lease = self.store.keep_lease(self.ttl, on_lost=self._on_lease_lost)
        res = self.store.txn(
            [Compare(self.key, "create", "=", 0)],
            success=[Put(self.key, self.id, lease.id)],
            failure=[Get(self.key)],
        )
        if not res.succeeded:
            lease.revoke()
            return False
        self.lease = lease
        self._lost.clear()
        self.token = res.revision  # the put's revision is the key's create_revision
        log.info("%s became leader (token %d)", self.id, self.token)
        return True

    def campaign(self, poll: float = 0.5) -> bool:
        """Block until leader (True) or ``stop()`` was called (False).

        Waits on a watch of the leader key, so a vacancy is seen at once; polls
        as a backstop in case the watch is slow to reconnect after an outage.
        """
        while not self._stop.is_set():
            try:
                if self.try_acquire():
                    return True
                watch = self.store.watch_prefix(self.key)
                try:
                    if not watch.initial:
                        continue
                    deadline = time.monotonic() + max(poll, self.ttl)
                    while not self._stop.is_set() and time.monotonic() < deadline:
                        ev = watch.get(timeout=poll)
                        if ev is not None and ev.type == "delete":
                            break
                finally:
                    watch.cancel()
            except EtcdError as e:
                log.info("%s: campaign attempt failed: %s", self.id, e)
                self._stop.wait(poll)
        return False

    def _on_lease_lost(self) -> None:
        if self.token:
            log.warning("%s lost its leader lease: stepping down", self.id)
        self._lost.set()

    def _release_local(self) -> None:
        if self.lease is not None:
            self.lease.stop()
        self.lease = None
        self.token = 0

    def resign(self) -> None:
        """Give up leadership (deletes our leader key if it is still ours)."""
        token, lease = self.token, self.lease
        self.token = 0
        if token:
            try:
                self.store.txn([Compare(self.key, "create", "=", token)], success=[Delete(self.key)])
            except EtcdError as e:
                log.info("%s: resign could not delete leader key (it will expire): %s", self.id, e)
        if lease is not None:
            lease.revoke()
        self.lease = None

    def stop(self) -> None:
        """Stop campaigning (campaign() returns False) and resign if leading."""
        self._stop.set()
        self.resign()

    # -- fenced writes -----------------------------------------------------------

    def fenced_txn(
        self, compares: Sequence[Compare] = (), success: Sequence[Op] = (), failure: Sequence[Op] = ()
    ) -> TxnResult:
        """A txn that applies only while our leader key is the one we created.

        Raises :class:`NotLeader` if we know we are not leader, or if etcd rejects
        the write because the leader key is gone or belongs to someone else (then
        we step down). If the caller's own ``compares`` fail, returns the result
        with ``succeeded=False`` as usual.
        """
        token = self.token
        if not self.is_leader:
            raise NotLeader(f"{self.id} is not the leader")
        return fenced_txn(self.store, token, compares, success, failure, on_fenced=self._fenced_out)

    def _fenced_out(self) -> None:
        log.warning("%s: fenced write rejected, another controller leads: stepping down", self.id)
        self._lost.set()
        self._release_local()


def fenced_txn(
    store: Store,
    token: int,
    compares: Sequence[Compare] = (),
    success: Sequence[Op] = (),
    failure: Sequence[Op] = (),
    on_fenced: object = None,
) -> TxnResult:
    """Run ``success`` iff the leader key's create_revision equals ``token`` and ``compares`` hold.

    Separate from :class:`Election` so that a test can replay a stale token.
    Raises :class:`NotLeader` when the fence fails.
    """
    fence = Compare(keys.leader(), "create", "=", token)
    res = store.txn([fence, *compares], success=list(success), failure=[Get(keys.leader()), *failure])
    if res.succeeded:
        return res
    leader_kvs = res.results[0]
    if not leader_kvs or leader_kvs[0].create_revision != token:
        if callable(on_fenced):
            on_fenced()
        holder = leader_kvs[0].value.decode() if leader_kvs else "nobody"
        raise NotLeader(f"fenced write rejected: token {token} is stale (leader is {holder})")
    return TxnResult(False, res.revision, res.results[1:])
