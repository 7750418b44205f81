"""Worker membership: workers register on a lease, the controller watches.

Worker side, :class:`Registration`: one key
``jobs/{job}/members/{group}/{worker}`` holding ``{node, pid, version, status,
progress_at, ...}`` attached to the worker's own lease. If the worker dies its
key vanishes when the lease expires; if the lease is lost while the worker
lives (etcd outage longer than the TTL, etcd restarted without the lease), the
registration re-registers with a fresh lease as soon as etcd answers again.

Controller side, :class:`MembershipView`: a live dict of members built from a
watch on ``jobs/{job}/members/``, with callbacks for join, update and leave.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from . import keys
from .store import EtcdError, Store
from .watch import KeptLease, Watch

log = logging.getLogger(__name__)


class Registration:
    """A worker's membership key, kept alive on its own lease.

    ``update(**fields)`` merges fields (status, version, progress...) into the
    value and writes it; ``progress_at`` is stamped on every update. Writes that
    fail because etcd is unreachable are kept and retried by the keep-alive
    thread, so a worker never blocks on etcd.
    """

    def __init__(self, store: Store, job: str, group: str, worker: str, *, ttl: int = 5, **fields: Any) -> None:
        self.store = store
        self.key = keys.member(job, group, worker)
        self.ttl = ttl
        self.info: dict[str, Any] = {
            "node": socket.gethostname(),
            "pid": os.getpid(),
            "status": "starting",
            **fields,
        }
        self._lock = threading.Lock()
        self._lease: KeptLease | None = None
        self._dirty = True
        self._closed = threading.Event()
        self._register()
        self._thread = threading.Thread(target=self._run, name=f"member:{worker}", daemon=True)
        self._thread.start()

    @property
    def lease_id(self) -> int:
        return self._lease.id if self._lease else 0

    def _register(self) -> None:
        with self._lock:
            if self._lease is None or self._lease.lost:
                if self._lease is not None:
                    self._lease.stop()
                self._lease = self.store.keep_lease(self.ttl)
                self._dirty = True
            if self._dirty:
                self.info["progress_at"] = time.time()
                self.store.put(self.key, json.dumps(self.info), lease=self._lease.id)
                self._dirty = False

    def update(self, **fields: Any) -> None:
        """Merge ``fields`` into the member value and write it (best effort, see class doc)."""
        with self._lock:
            self.info.update(fields)
            self._dirty = True
        try:
            self._register()
        except EtcdError as e:
            log.info("member %s: update deferred, etcd unreachable: %s", self.key, e)

    def _run(self) -> None:
        while not self._closed.wait(min(1.0, self.ttl / 3.0)):
            try:
                self._register()
            except EtcdError as e:
                log.debug("member %s: re-register failed: %s", self.key, e)

    def close(self) -> None:
        """Leave: revoke the lease (the key vanishes at once)."""
        self._closed.set()
        with self._lock:
            if self._lease is not None:
                self._lease.revoke()
                self._lease = None


Callback = Callable[[str, str, dict[str, Any]], None]


class MembershipView:
    """The live members of a job, from a watch.

    ``members`` maps ``(group, worker)`` to the member's value. ``on_join``,
    ``on_update`` and ``on_leave`` are called from the view's thread with
    ``(group, worker, info)``.
    """

    def __init__(
        self,
        store: Store,
        job: str,
        *,
        on_join: Callback | None = None,
        on_update: Callback | None = None,
        on_leave: Callback | None = None,
    ) -> None:
        self.job = job
        self.members: dict[tuple[str, str], dict[str, Any]] = {}
        self._cb = {"join": on_join, "update": on_update, "leave": on_leave}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._watch: Watch = store.watch_prefix(keys.members(job))
        for kv in self._watch.initial:
            self._apply("put", kv.key, kv.value)
        self._thread = threading.Thread(target=self._run, name=f"members:{job}", daemon=True)
        self._thread.start()

    def _apply(self, typ: str, key: str, value: bytes) -> None:
        parts = keys.split_member_key(key)
        if parts is None:
            return
        _, group, worker = parts
        with self._lock:
            existed = (group, worker) in self.members
            if typ == "put":
                info = json.loads(value)
                self.members[(group, worker)] = info
                kind = "update" if existed else "join"
            else:
                if not existed:
                    return
                info = self.members.pop((group, worker))
                kind = "leave"
            self._changed.notify_all()
        cb = self._cb[kind]
        if cb is not None:
            cb(group, worker, info)

    def _run(self) -> None:
        for ev in self._watch:
            self._apply(ev.type, ev.key, ev.value)

    def group(self, group: str) -> dict[str, dict[str, Any]]:
        """Snapshot of one group's members: ``{worker: info}``."""
        with self._lock:
            return {w: dict(i) for (g, w), i in self.members.items() if g == group}

    def wait_for(self, predicate: Callable[[dict[tuple[str, str], dict[str, Any]]], bool], timeout: float) -> bool:
        """Block until ``predicate(members)`` holds or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not predicate(self.members):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True

    def close(self) -> None:
        self._watch.cancel()
