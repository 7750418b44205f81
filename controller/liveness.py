"""A standby's fast channel to a dead leader: the leader's own connection.

A leader that is SIGKILLed (or whose process ends any other way) keeps its lease until
etcd expires it, ``ttl`` seconds after its last refresh: every standby waits that long to
campaign, and so does the job. The kernel, though, closes a dead process's sockets at once.
So each standby holds one HTTP stream open to the leader (``GET /api/v1/leader/alive?token=T``,
served by every controller: :func:`controller.http.api.create_app`):

* The leader answers only while it leads with fencing token ``T`` (else 409), writes a line
  every ``beat`` seconds, and ``bye`` when it stops leading (resigns, is fenced out, loses
  its lease): a clean end, after which the key goes by the usual path.
* A stream that ends **without** ``bye`` (EOF, reset), or a leader whose registered address
  refuses two connections in a row, means the leader's process is gone: the standby revokes
  the lease the leader key hangs on, the key goes, and the campaign (which watches it) runs
  at once. The lease is found from the leader key whose create revision is ``T``, so a
  standby can never revoke a newer leader's lease.
* Silence (a SIGSTOPped leader, a partition) proves nothing: the standby waits and the
  lease TTL decides, as before. A controller without an HTTP address (in-process use,
  benchmarks) has no fast channel either.

Safety does not rest on this: every leader write is fenced by its token
(:mod:`controller.election`). Should a live leader ever be deposed this way (its HTTP
server gone, its process not), its next lease refresh (every ``ttl / 3`` s) finds the lease
revoked and it steps down, and its etcd writes are refused before that.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from . import keys
from .store import EtcdError, Store

log = logging.getLogger(__name__)

PATH = "/api/v1/leader/alive"
BEAT_S = 1.0


@dataclass(frozen=True)
class Vacancy:
    """A leader found dead by its connection, whose lease this standby revoked."""

    leader: str
    token: int
    how: str  # "connection closed" | "connection refused"
    at: float  # wall time of the revoke


class LeaderWatch:
    """A standby's thread holding a stream to the leader; see the module doc.

    ``start()`` / ``stop()`` around a campaign (``stop`` does not wait: the thread ends at its
    next line or timeout, and can no longer revoke anything once another leader's key is
    there). ``vacancy`` is the last leader it found dead.
    """

    def __init__(self, store: Store, me: str, *, poll: float = 0.5, beat: float = BEAT_S) -> None:
        self.store = store
        self.me = me
        self.poll = poll
        self.beat = beat
        self.vacancy: Vacancy | None = None
        self._stop = threading.Event()
        self._reached: tuple[int, str] | None = None  # (token, url) that answered a stream
        self._thread: threading.Thread | None = None

    def start(self) -> LeaderWatch:
        self._stop = threading.Event()  # a thread of an earlier start keeps its own (set) event
        self._thread = threading.Thread(target=self._run, args=(self._stop,), name="leader-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    # -- the loop ---------------------------------------------------------------

    def _run(self, stop: threading.Event) -> None:
        refusals = 0
        while not stop.is_set():
            try:
                target = self._target()
            except EtcdError:
                target = None
            if target is None:
                stop.wait(self.poll)
                continue
            lid, token, lease, url = target
            try:
                ended = self._follow(url, token, stop)
            except httpx.ConnectError as e:
                # a refusal proves the process gone only where this leader's process answered before
                # (a wrong address, e.g. another node's 127.0.0.1, refuses too)
                refusals = refusals + 1 if self._reached == (token, url) and _refused(e) else 0
                if refusals >= 2:
                    self._vacate(lid, token, lease, "connection refused", stop)
                    refusals = 0
                stop.wait(0.25)
                continue
            except (httpx.TransportError, OSError):
                ended = "unknown"  # silence (a stopped process, a partition) proves nothing: the lease decides
            except Exception:  # noqa: BLE001 - this thread is an optimisation: the lease TTL stays the backstop
                log.exception("leader watch")
                ended = "unknown"
            refusals = 0
            if ended == "closed":
                self._vacate(lid, token, lease, "connection closed", stop)
            stop.wait(self.poll)

    def _target(self) -> tuple[str, int, int, str] | None:
        """(leader id, token, lease, url) of a leader other than us that serves HTTP."""
        kv = self.store.get(keys.leader())
        if kv is None or not kv.lease:
            return None
        lid = kv.value.decode()
        if lid == self.me:
            return None
        reg = self.store.get(keys.controller(lid))
        url = json.loads(reg.value).get("http") if reg else None
        if not url:
            return None
        return lid, kv.create_revision, kv.lease, str(url)

    def _follow(self, url: str, token: int, stop: threading.Event) -> str:
        """Hold the stream until it ends: "bye" (a clean end), "closed" (it ended without one: the
        process is gone), "refused" (it does not lead with this token: 409), "unknown"."""
        timeout = httpx.Timeout(connect=2.0, read=3 * self.beat + 2.0, write=2.0, pool=2.0)
        with httpx.Client(timeout=timeout) as client:
            with client.stream("GET", f"{url}{PATH}", params={"token": token}) as resp:
                if resp.status_code != 200:
                    return "refused"
                self._reached = (token, url)
                try:
                    for line in resp.iter_lines():
                        if line.strip() == "bye":
                            return "bye"
                        if stop.is_set():
                            return "unknown"
                except (httpx.RemoteProtocolError, httpx.ReadError):
                    pass  # EOF or a reset in the middle of the body
                return "unknown" if stop.is_set() else "closed"

    def _vacate(self, lid: str, token: int, lease: int, how: str, stop: threading.Event) -> None:
        """Revoke the dead leader's lease if the leader key is still the one it created."""
        if stop.is_set():
            return
        try:
            kv = self.store.get(keys.leader())
            if kv is None or kv.create_revision != token or kv.lease != lease:
                return  # gone already, or somebody else leads: nothing to do
            log.warning("leader %s (token %d): %s without a goodbye; its process is gone: revoking its lease %x",
                        lid, token, how, lease)  # fmt: skip
            self.store.lease_revoke(lease)
        except EtcdError as e:
            log.info("could not revoke leader %s's lease (it will expire): %s", lid, e)
            return
        self.vacancy = Vacancy(lid, token, how, time.time())


def _refused(e: BaseException) -> bool:
    """Whether a connect error is a refusal (nothing listens there), not a timeout or no route."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError) or "refused" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def alive_lines(is_leading: Any, token: int, beat: float = BEAT_S) -> Any:
    """The leader side's body: an async iterator of ``alive`` lines while ``is_leading(token)``,
    then ``bye``. (Its caller answers 409 before it if this controller does not lead with ``token``.)"""
    import asyncio

    async def gen() -> Any:
        while is_leading(token):
            yield "alive\n"
            await asyncio.sleep(beat)
        yield "bye\n"

    return gen()
