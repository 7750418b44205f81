"""Kept leases and resumable watches: the long-lived parts of the etcd adapter.

Split from :mod:`controller.store` (which owns connections and single calls);
both are reached through :class:`~controller.store.Store` (``keep_lease``,
``watch_prefix``).
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
from pyetcd import etcdrpc
from pyetcd.etcdrpc import kv_pb2

from .etcd_types import KV, EtcdError, EtcdUnavailable, WatchEvent, _b, _prefix_end, closed_under_us

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger(__name__)


class KeptLease:
    """A lease refreshed at TTL/3 by a daemon thread.

    ``valid_until()`` is a ``time.monotonic()`` instant before which the lease is
    certainly still alive in etcd (measured from when the last successful
    refresh was *sent*). ``on_lost`` is called once, from the keep-alive thread,
    when the lease is known expired or could not be refreshed before it expires.
    """

    def __init__(self, store: Store, ttl: int, on_lost: Callable[[], None] | None = None) -> None:
        self.store = store
        self.ttl = ttl
        self.on_lost = on_lost
        sent = time.monotonic()
        self.id = store.lease_grant(ttl)
        self._valid_until = sent + ttl
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{self.id:x}", daemon=True)
        self._thread.start()

    def valid_until(self) -> float:
        return self._valid_until

    @property
    def lost(self) -> bool:
        return self._lost.is_set() or time.monotonic() >= self._valid_until

    def _mark_lost(self) -> None:
        if not self._lost.is_set():
            self._lost.set()
            log.warning("lease %x lost", self.id)
            if self.on_lost is not None:
                self.on_lost()

    def _run(self) -> None:
        interval = self.ttl / 3.0
        while not self._stop.wait(interval if not self._lost.is_set() else 3600):
            sent = time.monotonic()
            try:
                remaining = self.store.lease_refresh(self.id)
            except EtcdError as e:
                log.info("lease %x refresh failed: %s", self.id, e)
                if time.monotonic() >= self._valid_until:
                    self._mark_lost()
                interval = min(self.ttl / 3.0, 0.5)
                continue
            interval = self.ttl / 3.0
            if remaining <= 0:
                self._mark_lost()
            else:
                self._valid_until = sent + remaining

    def revoke(self) -> None:
        """Stop refreshing and revoke the lease (its keys vanish at once)."""
        self._stop.set()
        try:
            self.store.lease_revoke(self.id)
        except EtcdError as e:
            log.info("lease %x revoke failed (it will expire): %s", self.id, e)

    def stop(self) -> None:
        """Stop refreshing; the lease expires after its TTL."""
        self._stop.set()


_END = object()


class Watch:
    """An iterator of :class:`WatchEvent` under a prefix that outlives etcd restarts.

    A daemon thread keeps a gRPC watch stream open. When the stream breaks it
    reconnects (jittered backoff) and resumes from ``last_revision + 1``. When
    etcd reports the resume revision compacted, it re-lists the prefix and emits
    a put for every key changed since the last delivery and a delete for every
    key that vanished, then watches on from the listing's revision + 1.

    A progress notice never advances ``last_revision``: etcd before 3.5.8 / 3.4.25 may send
    one just before the last events on the same stream, and events behind it would then be
    skipped as delivered (etcd issue #15220). A resume after a long quiet spell may meet a
    compaction instead, and re-lists.
    """

    def __init__(self, store: Store, prefix: str, start_revision: int | None) -> None:
        self.store = store
        self.prefix = prefix
        self._q: queue.Queue[Any] = queue.Queue()
        self._stop = threading.Event()
        self._call: Any = None
        self._known: dict[str, int] = {}  # key -> mod_revision, to diff after a compaction
        self.initial: list[KV] = []
        self.initial_revision = 0
        self.reconnects = 0
        self.resyncs = 0
        self._stale_tokens = 0  # stale-token cancels in a row (see _run)
        if start_revision is None:
            self.initial, self.initial_revision = store.range(prefix)
            self._known = {kv.key: kv.mod_revision for kv in self.initial}
            self.last_revision = self.initial_revision
        else:
            self.last_revision = start_revision - 1
            try:
                kvs, _ = store.range(prefix, revision=max(start_revision - 1, 0)) if start_revision > 1 else ([], 0)
                self._known = {kv.key: kv.mod_revision for kv in kvs}
            except EtcdError:
                self._known = {}  # revision compacted: the stream's compaction path will re-list
        self._thread = threading.Thread(target=self._run, name=f"watch:{prefix}", daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator[WatchEvent]:
        return self

    def __next__(self) -> WatchEvent:
        ev = self.get()
        if ev is None:
            raise StopIteration
        return ev

    def get(self, timeout: float | None = None) -> WatchEvent | None:
        """Next event; None on timeout or once cancelled."""
        try:
            item = self._q.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is _END:
            self._q.put(_END)
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()
        self._q.put(_END)

    def _emit(self, ev: WatchEvent) -> None:
        if ev.type == "put":
            self._known[ev.key] = ev.revision
        else:
            self._known.pop(ev.key, None)
        self._q.put(ev)

    def _resync(self) -> None:
        kvs, rev = self.store.range(self.prefix)
        self.resyncs += 1
        seen = set()
        for kv in kvs:
            seen.add(kv.key)
            if self._known.get(kv.key, 0) < kv.mod_revision and kv.mod_revision > self.last_revision:
                self._emit(WatchEvent("put", kv.key, kv.value, kv.mod_revision))
        for key in sorted(set(self._known) - seen):
            self._emit(WatchEvent("delete", key, b"", rev))
        self.last_revision = rev

    def _requests(self, start: int, done: threading.Event) -> Iterator[Any]:
        pfx = _b(self.prefix)
        yield etcdrpc.WatchRequest(
            create_request=etcdrpc.WatchCreateRequest(
                key=pfx, range_end=_prefix_end(pfx), start_revision=start, progress_notify=True
            )
        )
        done.wait()  # keep the request side open until the stream ends

    def _run(self) -> None:
        backoff = 0.05
        while not self._stop.is_set():
            done = threading.Event()
            stalled = threading.Event()
            shared = own = None
            timer: threading.Timer | None = None
            try:
                shared, own, md = self.store._stream_channel()
                stub = etcdrpc.WatchStub(own)
                call = stub.Watch(self._requests(self.last_revision + 1, done), metadata=md)
                self._call = call
                if self._stop.is_set():
                    call.cancel()
                # A stream opened just as etcd went down can sit unsent on the dead channel for
                # grpc's connect timeout (20 s) without failing: one not confirmed by etcd within
                # the store's timeout is cancelled and reopened.
                created = threading.Event()

                def unconfirmed(
                    call: Any = call, created: threading.Event = created, stalled: threading.Event = stalled
                ) -> None:
                    if not created.is_set():
                        stalled.set()
                        call.cancel()

                timer = threading.Timer(self.store.timeout, unconfirmed)
                timer.daemon = True
                timer.start()
                # Seen with etcd restarting (grpc 1.85): the stream ended (UNAVAILABLE, so cancel()
                # had nothing to cancel) while the iterator below went on waiting for a message
                # that never came, until the channel closed. The channel is this stream's own:
                # closed one second after the call ended if the iterator has not let go by then.
                call.add_done_callback(lambda _c, own=own, done=done: _close_if_stuck(own, done))
                for resp in call:
                    created.set()
                    backoff = 0.05
                    if resp.compact_revision:
                        log.warning(
                            "watch %s: revision compacted (%d), re-listing",
                            self.prefix,
                            resp.compact_revision,
                        )
                        self._resync()
                        self._call.cancel()
                        break  # reopen from the new last_revision
                    if resp.canceled:
                        if _stale_token(resp.cancel_reason) and self._stale_tokens < 3:
                            # etcd's simple tokens die with the server: log in again, reopen
                            self._stale_tokens += 1
                            self.store._drop_token(md)
                            log.info("watch %s: token refused (%s), logging in again", self.prefix,
                                     resp.cancel_reason)  # fmt: skip
                            break
                        raise EtcdError(f"watch cancelled by etcd: {resp.cancel_reason}")
                    self._stale_tokens = 0
                    # every event of one revision (a txn's puts, the keys of a revoked or expired
                    # lease) comes in one response: compare with what was delivered before it
                    delivered = self.last_revision
                    for ev in resp.events:
                        kv = ev.kv
                        rev = kv.mod_revision
                        if rev <= delivered:
                            continue  # already delivered before a reconnect
                        typ = "delete" if ev.type == kv_pb2.Event.DELETE else "put"
                        self._emit(WatchEvent(typ, kv.key.decode(), bytes(kv.value), rev))
                        self.last_revision = rev
            except grpc.RpcError as e:
                if self._stop.is_set():
                    break
                self.reconnects += 1
                why = "not confirmed by etcd in time" if stalled.is_set() else e.code().name
                log.info("watch %s: stream broke (%s), reconnecting", self.prefix, why)
                self.store._rotate(shared)
            except EtcdUnavailable as e:
                log.info("watch %s: %s, retrying", self.prefix, e)
            except ValueError as e:
                if not closed_under_us(e):
                    self._q.put(EtcdError(f"watch {self.prefix} failed: {e!r}"))
                    return
                self.reconnects += 1  # another thread's reconnect closed the channel: open a new one
                log.info("watch %s: channel closed by a reconnect, reopening", self.prefix)
            except Exception as e:  # noqa: BLE001 - surfaced to the consumer, not swallowed
                self._q.put(e if isinstance(e, EtcdError) else EtcdError(f"watch {self.prefix} failed: {e!r}"))
                return
            finally:
                done.set()
                if timer is not None:
                    timer.cancel()
                if own is not None:
                    own.close()  # the stream has ended: nothing else is on this channel
            if not self._stop.is_set():
                time.sleep(backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, 1.0)


def _stale_token(reason: str) -> bool:
    """Whether etcd cancelled a watch for its token (expired, or issued by a server since restarted)."""
    low = (reason or "").lower()
    return "auth token" in low or "revision of auth store is old" in low


def _close_if_stuck(channel: grpc.Channel, done: threading.Event) -> None:
    """The call on ``channel`` has ended: if its stream's loop has not ended within a second,
    close the channel (the stream's own), which ends every wait on it."""

    def check() -> None:
        if not done.is_set():
            log.info("watch: the stream ended but its iterator did not; closing its channel")
            channel.close()

    t = threading.Timer(1.0, check)
    t.daemon = True
    t.start()
