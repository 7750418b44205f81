"""Worker membership: workers register on a lease, the controller watches.

Worker side, :class:`Registration`: one key
``jobs/{job}/members/{group}/{worker}`` holding ``{node, pid, version, status,
progress_at, ...}`` attached to the worker's own lease. If the worker dies its
key vanishes when the lease expires; if the lease is lost while the worker
lives (etcd outage longer than the TTL, etcd restarted without the lease), the
registration re-registers with a fresh lease as soon as etcd answers again.
Each registration is one *incarnation* (a random id in the value): its first
write takes the key whoever held it (a new worker is newer than the one it
replaces), every later write is a compare-and-swap on the key's revision as this
incarnation last left it. A worker that comes back after being replaced (SIGCONT
after SIGSTOP, a healed partition) finds another incarnation there: it writes
nothing more and is told (``on_superseded``) so that it can exit.

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
import uuid
from collections.abc import Callable
from typing import Any

from . import keys
from .store import Compare, EtcdError, Get, Put, Store
from .watch import KeptLease, Watch

log = logging.getLogger(__name__)


def swap(
    store: Store, key: str, value: str, lease: int, mod: int | None, incarnation: str
) -> tuple[int, dict[str, Any] | None]:
    """Write a member ``value`` as ``incarnation`` (see module doc): ``(mod revision, None)``, or
    ``(0, the value held)`` when another incarnation holds the key. ``mod`` None: the
    incarnation's first write, which takes the key; else a compare-and-swap on ``mod`` (0: not
    known, e.g. after the key was dropped), taking the key back if it is gone or already ours."""
    if mod is None:
        return store.put(key, value, lease=lease), None
    for _ in range(3):
        res = store.txn([Compare(key, "mod", "=", mod)], [Put(key, value, lease)], [Get(key)])
        if res.succeeded:
            return res.revision, None
        kvs = res.results[0]
        if not kvs:  # gone with a lost lease and nobody took it: ours again
            res = store.txn([Compare(key, "create", "=", 0)], [Put(key, value, lease)], [Get(key)])
            if res.succeeded:
                return res.revision, None
            kvs = res.results[0]
            if not kvs:
                continue
        try:
            held = json.loads(kvs[0].value)
        except ValueError:
            held = {}
        if isinstance(held, dict) and held.get("incarnation") == incarnation:
            mod = kvs[0].mod_revision  # our own write whose answer was lost: swap from it
            continue
        return 0, held if isinstance(held, dict) else {}
    raise EtcdError(f"member {key}: the key kept changing under a compare-and-swap")


class Member:
    """What every kind of membership registration shares: the value (``info``) under one
    incarnation, its generations (the newest one set, the newest one written), ``update``,
    ``note``, ``flush`` and what happens once another incarnation holds the key. Subclasses
    decide how the value reaches etcd: :class:`Registration` on a lease of its own,
    :class:`~controller.nodeagent.NodeRegistration` through the node's agent. Each calls
    ``_start`` once it can write, raises ``_written`` as etcd confirms a generation, and calls
    ``_superseded_by`` once another incarnation holds the key."""

    def __init__(
        self,
        job: str,
        group: str,
        worker: str,
        *,
        ttl: int,
        on_superseded: Callable[[dict[str, Any]], None] | None,
        fields: dict[str, Any],
    ) -> None:
        self.key = keys.member(job, group, worker)
        self.ttl = ttl
        self.incarnation = uuid.uuid4().hex[:16]
        self.info: dict[str, Any] = {
            "node": socket.gethostname(),
            "pid": os.getpid(),
            "status": "starting",
            **fields,
            "incarnation": self.incarnation,
        }
        self.info["progress_at"] = time.time()
        self._lock = threading.Lock()
        self._gen, self._written = 1, 0  # value generation, and the newest one etcd has
        self._on_superseded = on_superseded
        self.superseded: dict[str, Any] | None = None  # the value that replaced ours, once it has
        self._closed = threading.Event()
        self._wake = threading.Event()

    @property
    def lease_id(self) -> int:
        raise NotImplementedError

    def update(self, **fields: Any) -> None:
        """Merge ``fields`` into the member value; written soon by the registration's thread
        (see class doc). Never blocks on etcd."""
        self.note(**fields)
        self._wake.set()

    def note(self, **fields: Any) -> None:
        """``update`` without waking the writer: the value is written at its next period (at
        most ``ttl / 3``, 1 s) or with the next ``update``, whichever comes first. For a
        status that matters only if it lasts (a weight load): a short one costs no write."""
        with self._lock:
            self.info.update(fields)
            self.info["progress_at"] = time.time()
            self._gen += 1

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the newest value is written; False if it is not within ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._written == self._gen:
                    return True
                if self.superseded is not None:
                    return False
            self._wake.set()
            time.sleep(0.02)
        return False

    def close(self) -> None:
        raise NotImplementedError

    def _superseded_by(self, held: dict[str, Any]) -> None:
        """Another incarnation holds the key: write no more, and tell the owner."""
        with self._lock:
            self.superseded = held
        log.warning(
            "member %s: replaced by pid %s (incarnation %s); this one (pid %s) writes no more",
            self.key, held.get("pid"), held.get("incarnation"), os.getpid(),
        )  # fmt: skip
        if self._on_superseded is not None:
            self._on_superseded(held)

    def _start(self, worker: str) -> None:
        self._thread = threading.Thread(target=self._run, name=f"member:{worker}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        raise NotImplementedError


class Registration(Member):
    """A worker's membership key, kept alive on its own lease.

    ``update(**fields)`` merges fields (status, version, progress...) into the
    value and returns at once: the registration's own thread writes it, coalescing
    updates that arrive while a write is in progress or etcd is unreachable (the
    newest value wins). ``progress_at`` is stamped when ``update`` is called, not
    when the write lands. So a worker's step never waits on etcd: an etcd outage
    used to stall ``train_step`` and ``generate_shard`` for the store's whole retry
    window.
    """

    def __init__(
        self,
        store: Store,
        job: str,
        group: str,
        worker: str,
        *,
        ttl: int = 5,
        on_superseded: Callable[[dict[str, Any]], None] | None = None,
        **fields: Any,
    ) -> None:
        super().__init__(job, group, worker, ttl=ttl, on_superseded=on_superseded, fields=fields)
        self.store = store
        self._lease: KeptLease | None = None
        self._mod: int | None = None  # the key's mod revision as this incarnation last wrote it
        self._register()
        self._start(worker)

    @property
    def lease_id(self) -> int:
        return self._lease.id if self._lease else 0

    def _register(self) -> None:
        """Write the value if it changed; first a new lease if the old one was lost. etcd is
        called outside the lock (``update`` takes it)."""
        with self._lock:
            old = self._lease
        if old is None or old.lost:
            if old is not None:
                old.stop()
            new = self.store.keep_lease(self.ttl)
            with self._lock:
                if self._closed.is_set():
                    new.revoke()
                    return
                self._lease, self._written = new, 0  # a new lease: the key must be written again
        with self._lock:
            assert self._lease is not None
            value, lease, gen = json.dumps(self.info), self._lease.id, self._gen
            if gen == self._written or self.superseded is not None:
                return
        if not self._write(value, lease):  # outside the lock: update() never waits for etcd
            return
        with self._lock:
            if self._lease is not None and self._lease.id == lease:
                self._written = max(self._written, gen)

    def _write(self, value: str, lease: int) -> bool:
        """Write the value as this incarnation; False (and ``on_superseded``) once another holds
        the key. The first write takes the key; later ones swap only what this one wrote."""
        mod, held = swap(self.store, self.key, value, lease, self._mod, self.incarnation)
        if held is None:
            self._mod = mod
            return True
        self._superseded_by(held)
        return False

    def _run(self) -> None:
        period = min(1.0, self.ttl / 3.0)
        while not self._closed.is_set():
            self._wake.wait(period)
            self._wake.clear()
            if self._closed.is_set():
                return
            try:
                self._register()
            except EtcdError as e:
                log.debug("member %s: write deferred, etcd unreachable: %s", self.key, e)
            if self.superseded is not None:  # another incarnation holds the key: nothing more to keep
                with self._lock:
                    lease, self._lease = self._lease, None
                if lease is not None:
                    lease.stop()  # not revoked: it expires, and the key is on the holder's lease
                return

    def close(self) -> None:
        """Leave: revoke the lease (the key vanishes at once)."""
        self._closed.set()
        with self._lock:
            if self._lease is not None:
                self._lease.revoke()
                self._lease = None


Callback = Callable[[str, str, dict[str, Any]], None]


class MembershipView:
    """The live members of a job, from a watch on the job's own prefix.

    ``members`` maps ``(group, worker)`` to the member's value. ``on_join``,
    ``on_update`` and ``on_leave`` are called from the view's thread with
    ``(group, worker, info)``.

    Values are decoded lazily: the view keeps each member's raw value and its revision,
    and decodes one when it is read (once per revision) or when a callback needs it. So a
    view of a large job does not decode every progress put of every worker, only what its
    readers ask for; with no callbacks set, an update costs a dict store (BENCHMARKS.md
    section 6: the controller's CPU at 2,000 workers fell from 0.151 to 0.121 core).
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
        self._raw: dict[tuple[str, str], tuple[int, bytes]] = {}  # (group, worker) -> (mod revision, value)
        self._decoded: dict[tuple[str, str], tuple[int, dict[str, Any]]] = {}  # the same, once read
        self._cb = {"join": on_join, "update": on_update, "leave": on_leave}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._watch: Watch = store.watch_prefix(keys.members(job))
        for kv in self._watch.initial:
            self._apply("put", kv.key, kv.value, kv.mod_revision)
        self._thread = threading.Thread(target=self._run, name=f"members:{job}", daemon=True)
        self._thread.start()

    def _info(self, k: tuple[str, str]) -> dict[str, Any]:
        """Member ``k``'s value, decoded once per revision (the caller holds the lock). A value
        that is not a JSON object reads as ``{}``."""
        rev, raw = self._raw[k]
        hit = self._decoded.get(k)
        if hit is not None and hit[0] == rev:
            return hit[1]
        try:
            info = json.loads(raw)
        except ValueError:
            info = None
        info = info if isinstance(info, dict) else {}
        self._decoded[k] = (rev, info)
        return info

    def _apply(self, typ: str, key: str, value: bytes, rev: int) -> None:
        parts = keys.split_member_key(key)
        if parts is None:
            return
        _, group, worker = parts
        k = (group, worker)
        info: dict[str, Any] = {}
        with self._lock:
            existed = k in self._raw
            if typ == "put":
                self._raw[k] = (rev, value)
                kind = "update" if existed else "join"
                if self._cb[kind] is not None:
                    info = dict(self._info(k))
            else:
                if not existed:
                    return
                kind = "leave"
                if self._cb[kind] is not None:
                    info = dict(self._info(k))
                del self._raw[k]
                self._decoded.pop(k, None)
            self._changed.notify_all()
        cb = self._cb[kind]
        if cb is not None:
            cb(group, worker, info)

    def _run(self) -> None:
        for ev in self._watch:
            self._apply(ev.type, ev.key, ev.value, ev.revision)

    @property
    def members(self) -> dict[tuple[str, str], dict[str, Any]]:
        """Snapshot of every member: ``{(group, worker): info}`` (copies)."""
        with self._lock:
            return {k: dict(self._info(k)) for k in self._raw}

    def group(self, group: str) -> dict[str, dict[str, Any]]:
        """Snapshot of one group's members: ``{worker: info}`` (copies; only this group is decoded)."""
        with self._lock:
            return {w: dict(self._info((g, w))) for (g, w) in self._raw if g == group}

    def __len__(self) -> int:
        with self._lock:
            return len(self._raw)

    def wait_for(self, predicate: Callable[[dict[tuple[str, str], dict[str, Any]]], bool], timeout: float) -> bool:
        """Block until ``predicate(members)`` holds or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not predicate({k: self._info(k) for k in self._raw}):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True

    def close(self) -> None:
        self._watch.cancel()
