"""etcd v3 store adapter: the only module that talks gRPC to etcd.

We use the generated etcd v3 protocol stubs shipped by ``etcd-sdk-python``
(import name ``pyetcd``) but not its client object: that client hides response
headers (revisions), its watcher does not reconnect after an etcd restart, and
lease keep-alive is left to the caller. This adapter owns all three:

* every call carries a deadline (``timeout``) and is retried with tenacity on
  transient errors only (UNAVAILABLE, DEADLINE_EXCEEDED for reads), jittered and
  bounded in time (``retry_window``), rotating through the endpoints;
* ``txn`` is never retried blindly: an ambiguous failure raises
  :class:`EtcdUnavailable` and the caller re-reads and compares;
* :class:`KeptLease` refreshes its lease at TTL/3 in a background thread and
  knows until when it is certainly still valid; every lease of a ``Store`` is
  refreshed over one long-lived ``LeaseKeepAlive`` stream (not a stream per
  keep-alive), re-opened when it breaks;
* :meth:`Store.watch_prefix` survives disconnects and etcd restarts by resuming
  from the last delivered revision + 1, and on compaction re-lists the prefix and
  emits the difference, so a consumer never misses or double-sees an event.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import tenacity
from pyetcd import etcdrpc

# shared with controller/watch.py, apart so the two do not import each other (re-exported: callers import them here)
from .etcd_types import KV, EtcdError, EtcdUnavailable, WatchEvent, _b, _prefix_end, closed_under_us  # noqa: F401

if TYPE_CHECKING:
    from .watch import KeptLease, Watch

log = logging.getLogger(__name__)

_TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


def _transient(e: grpc.RpcError) -> bool:
    """Worth a retry on another channel: etcd unreachable or slow, or the call was in flight on
    a channel that another thread's reconnect closed (CANCELLED "Channel closed!"; like a
    deadline, ambiguous for a write: it may have been applied)."""
    code = e.code()
    return code in _TRANSIENT or (code == grpc.StatusCode.CANCELLED and "channel closed" in (e.details() or "").lower())


# --- compares and operations for txn -----------------------------------------

_TARGETS = {
    "value": etcdrpc.Compare.VALUE,
    "version": etcdrpc.Compare.VERSION,
    "create": etcdrpc.Compare.CREATE,
    "mod": etcdrpc.Compare.MOD,
}
_RESULTS = {
    "=": etcdrpc.Compare.EQUAL,
    "!=": etcdrpc.Compare.NOT_EQUAL,
    "<": etcdrpc.Compare.LESS,
    ">": etcdrpc.Compare.GREATER,
}


@dataclass(frozen=True)
class Compare:
    """``Compare(key, "create", "=", rev)``: target one of value/version/create/mod."""

    key: str
    target: str
    op: str
    value: int | bytes | str

    def _pb(self) -> Any:
        if self.target not in _TARGETS or self.op not in _RESULTS:
            raise ValueError(f"bad compare {self}")
        c = etcdrpc.Compare(key=_b(self.key), target=_TARGETS[self.target], result=_RESULTS[self.op])
        if self.target == "value":
            c.value = _b(self.value)  # type: ignore[arg-type]
        elif self.target == "version":
            c.version = int(self.value)
        elif self.target == "create":
            c.create_revision = int(self.value)
        else:
            c.mod_revision = int(self.value)
        return c


@dataclass(frozen=True)
class Put:
    key: str
    value: bytes | str
    lease: int = 0


@dataclass(frozen=True)
class Delete:
    key: str
    prefix: bool = False


@dataclass(frozen=True)
class Get:
    key: str
    prefix: bool = False


Op = Put | Delete | Get


@dataclass(frozen=True)
class TxnResult:
    """``succeeded``: whether the compares held. ``results``: one per op of the
    branch that ran; a list of KV for Get, the deleted count for Delete, None for Put."""

    succeeded: bool
    revision: int
    results: list[Any]


def _op_pb(op: Op) -> Any:
    if isinstance(op, Put):
        return etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=_b(op.key), value=_b(op.value), lease=op.lease))
    if isinstance(op, Delete):
        req = etcdrpc.DeleteRangeRequest(key=_b(op.key))
        if op.prefix:
            req.range_end = _prefix_end(_b(op.key))
        return etcdrpc.RequestOp(request_delete_range=req)
    req = etcdrpc.RangeRequest(key=_b(op.key))
    if op.prefix:
        req.range_end = _prefix_end(_b(op.key))
    return etcdrpc.RequestOp(request_range=req)


# Credentials a Store falls back to when its caller gives none: workers (Ray
# actors) build ``Store(endpoints)`` only, so TLS and auth reach them through
# their environment. An explicit argument wins; "" means "none" even if set.
ENV_CA = "RRL_ETCD_CA"
ENV_CERT = "RRL_ETCD_CERT"
ENV_KEY = "RRL_ETCD_KEY"
ENV_USER = "RRL_ETCD_USER"
ENV_PASSWORD = "RRL_ETCD_PASSWORD"  # noqa: S105 - the variable's name, not a password

# grpc's words for a failed TLS handshake (client or server side)
_TLS_WORDS = ("ssl", "tls", "tsi_", "handshake", "certificate", "unwrap failed", "wrong_version_number")
# etcd's errors that mean "log in again" (its simple tokens die with the server)
_STALE_TOKEN = ("invalid auth token", "revision of auth store is old", "auth token")


class _Answer:
    """One keep-alive request's answer: its TTL, or the error that ended its stream."""

    __slots__ = ("error", "event", "ttl")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.ttl = 0
        self.error: BaseException | None = None


class _KeepAliveStream:
    """A ``LeaseKeepAlive`` stream shared by every lease a :class:`Store` refreshes.

    Requests go in through a queue; etcd answers each stream's requests in order, so the
    answers for one lease ID are matched first in, first out. When the stream ends (an error,
    a cancel, etcd gone) every request still waiting fails with the reason and the stream is
    not used again. A request that gets no answer within the store's timeout cancels the
    stream: a late answer can then never be taken for a later request's (whose ``valid_until``
    would start from the wrong send time, trusting the lease longer than etcd does)."""

    def __init__(self, channel: grpc.Channel, md: tuple[tuple[str, str], ...] | None) -> None:
        self.channel, self.md = channel, md
        self.requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waiting: dict[int, deque[_Answer]] = {}
        self.dead: BaseException | None = None

        def feed() -> Iterator[Any]:
            while (item := self.requests.get()) is not None:
                yield item

        self.call = etcdrpc.LeaseStub(channel).LeaseKeepAlive(feed(), metadata=md)
        # grpc may leave a stream's iterator waiting after the call ended (seen with watches): its
        # end is also taken from the call itself
        self.call.add_done_callback(lambda _c: self.fail(EtcdUnavailable("etcd LeaseKeepAlive: the stream ended")))

    def usable(self) -> bool:
        return self.dead is None and not self.call.done()

    def ask(self, lease_id: int) -> _Answer:
        a = _Answer()
        with self._lock:
            if self.dead is not None:
                raise self.dead
            self._waiting.setdefault(lease_id, deque()).append(a)
        self.requests.put(etcdrpc.LeaseKeepAliveRequest(ID=lease_id))
        return a

    def answer(self, lease_id: int, ttl: int) -> None:
        with self._lock:
            waiting = self._waiting.get(lease_id)
            a = waiting.popleft() if waiting else None
            if waiting is not None and not waiting:
                del self._waiting[lease_id]
        if a is not None:
            a.ttl = ttl
            a.event.set()

    def fail(self, error: BaseException) -> None:
        """The stream is over: fail everything still waiting (the first reason given wins)."""
        with self._lock:
            if self.dead is None:
                self.dead = error
            pending = [a for w in self._waiting.values() for a in w]
            self._waiting.clear()
        for a in pending:
            a.error = self.dead
            a.event.set()
        self.requests.put(None)  # ends the request feed

    def cancel(self, error: BaseException) -> None:
        self.fail(error)
        self.call.cancel()


def _env(value: str | None, name: str) -> str | None:
    if value is None:
        value = os.environ.get(name)
    return value or None


def _read_pem(path: str, what: str, env: str) -> bytes:
    """The bytes of a PEM file, or a ValueError naming the file, what it is for and where it came from."""
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as e:
        raise ValueError(f"etcd {what} file {path}: {e.strerror or e} (given as {env} or the matching flag)") from None
    if b"-----BEGIN" not in data:
        raise ValueError(f"etcd {what} file {path} is not PEM (no -----BEGIN line)")
    return data


def parse_endpoints(endpoints: str | Sequence[str]) -> list[str]:
    """``"h1:2379,h2:2379"`` or a list -> ``["h1:2379", "h2:2379"]``; ``http://`` stripped."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out = []
    for e in items:
        e = e.strip()
        for scheme in ("http://", "https://"):
            if e.startswith(scheme):
                e = e[len(scheme) :]
        if not e:
            continue
        host, sep, port = e.rpartition(":")
        if not sep or not host:
            raise ValueError(f"etcd endpoint {e!r} must be host:port")
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"etcd endpoint {e!r}: the port must be a number from 1 to 65535")
        out.append(e)
    if not out:
        raise ValueError("no etcd endpoint given")
    return out


class Store:
    """A connection to an etcd cluster (one or more endpoints).

    Thread-safe: gRPC channels and stubs may be shared between threads.
    ``timeout`` is the deadline of one call; ``retry_window`` bounds the total
    time spent retrying a transient failure before :class:`EtcdUnavailable`.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        timeout: float = 3.0,
        retry_window: float = 10.0,
        ca_cert: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        user: str | None = None,
        password: str | None = None,
    ) -> None:
        """TLS is on when a CA, a client certificate or an ``https://`` endpoint is
        given (without a CA the system's roots verify the server); ``cert`` and
        ``key`` are the client certificate and its key (PEM files). ``user`` and
        ``password`` log in with etcd's auth (a token per connection, renewed
        when etcd forgets it). Each credential not given falls back to its
        ``RRL_ETCD_*`` variable (see ``ENV_*``). Raises ValueError for a bad
        endpoint or an unreadable / half-given credential; never shows the
        password or key contents (not in errors, logs or ``repr``).
        """
        items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
        https = any(e.strip().startswith("https://") for e in items)
        self.endpoints = parse_endpoints(endpoints)
        self.timeout = timeout
        self.retry_window = retry_window
        ca_cert, cert, key = _env(ca_cert, ENV_CA), _env(cert, ENV_CERT), _env(key, ENV_KEY)
        user, password = _env(user, ENV_USER), _env(password, ENV_PASSWORD)
        if (cert is None) != (key is None):
            raise ValueError(
                f"etcd client certificate and key go together: give both ({ENV_CERT} and {ENV_KEY}, "
                "or --etcd-cert and --etcd-key)"
            )
        if password is not None and user is None:
            raise ValueError(f"an etcd password was given without a user name ({ENV_USER} / --etcd-user)")
        self.tls = bool(https or ca_cert or cert)
        self._creds = None
        if self.tls:
            ca = _read_pem(ca_cert, "CA", ENV_CA) if ca_cert else None
            cc = _read_pem(cert, "client certificate", ENV_CERT) if cert else None
            ck = _read_pem(key, "client key", ENV_KEY) if key else None
            self._creds = grpc.ssl_channel_credentials(ca, ck, cc)
        self._client_cert = cert is not None
        self._user, self._password = user, password
        self._lock = threading.Lock()  # the channel, the token, the retired channels: never held over an RPC
        self._auth_lock = threading.Lock()  # one login at a time
        self._ep_index = random.randrange(len(self.endpoints))
        self._channel: grpc.Channel | None = None
        # channels dropped by _rotate, closed only once no call can still be on them (see _rotate)
        self._retired: list[tuple[float, grpc.Channel]] = []
        self._metadata: tuple[tuple[str, str], ...] | None = None
        self._closed = False
        self._keepalive: _KeepAliveStream | None = None  # every lease's refreshes (see lease_refresh)
        self._keepalive_lock = threading.Lock()
        self.keepalive_streams = 0  # how many LeaseKeepAlive streams this store opened (tests, benchmarks)

    def __repr__(self) -> str:
        who = f", user={self._user!r}, password=***" if self._user is not None else ""
        cert = ", client_cert=True" if self._client_cert else ""
        return f"Store({','.join(self.endpoints)!r}, tls={self.tls}{cert}{who})"

    __str__ = __repr__

    # -- connection management ----------------------------------------------

    @property
    def endpoint(self) -> str:
        return self.endpoints[self._ep_index]

    def _open(self, ep: str) -> grpc.Channel:
        opts = [("grpc.max_receive_message_length", 64 << 20)]
        if self._creds is not None:
            return grpc.secure_channel(ep, self._creds, options=opts)
        return grpc.insecure_channel(ep, options=opts)

    def _connect_locked(self) -> grpc.Channel:
        if self._channel is None:
            self._channel = self._open(self.endpoints[self._ep_index])
            self._metadata = None
        return self._channel

    def _stream_channel(self) -> tuple[grpc.Channel, grpc.Channel, tuple[tuple[str, str], ...] | None]:
        """For one watch stream: the shared channel (to hand to :meth:`_rotate` if the stream
        fails), a new channel of the stream's own to the same endpoint, and the token to call
        with (a login is done on the shared channel if needed; etcd's tokens are the cluster's,
        not a connection's). The caller closes its own channel once its stream has ended:
        nothing else is on it, so it may also close it to end a stream that grpc left hanging."""
        shared, md = self._stubs()
        return shared, self._open(self.endpoint), md

    def _login(self, channel: grpc.Channel) -> tuple[tuple[str, str], ...]:
        """Log in as ``self._user`` on ``channel``; the token goes with every call on it.

        The Authenticate RPC runs outside the Store lock (it may take up to ``timeout``: other
        threads must still be able to drop a channel or close the store meanwhile); one login
        at a time (``_auth_lock``), and a login another thread finished meanwhile is reused."""
        with self._auth_lock:
            with self._lock:
                if self._channel is channel and self._metadata is not None:
                    return self._metadata
            try:
                resp = etcdrpc.AuthStub(channel).Authenticate(
                    etcdrpc.AuthenticateRequest(name=self._user, password=self._password or ""),
                    timeout=self.timeout,
                )
            except grpc.RpcError as e:
                err = self._error("Authenticate", e)
                with self._lock:
                    if self._channel is channel:
                        self._retired.append((time.monotonic(), channel))
                        self._channel = None
                        if e.code() in _TRANSIENT:
                            self._ep_index = (self._ep_index + 1) % len(self.endpoints)
                if isinstance(err, EtcdUnavailable):  # a login applies nothing: retried even inside a write
                    raise err from None
                raise err from e
            md = (("token", resp.token),)
            with self._lock:
                if self._channel is channel:
                    self._metadata = md
            return md

    def _drop_token(self, md: tuple[tuple[str, str], ...] | None) -> None:
        """Forget a token etcd no longer accepts; the next call logs in again."""
        with self._lock:
            if self._metadata is md:
                self._metadata = None

    def _error(self, method: str, e: grpc.RpcError) -> EtcdError:
        """An RpcError as an EtcdError whose message names the endpoint and says what to check.

        Never contains the password or key: etcd's and grpc's details do not carry them.
        """
        code, details = e.code(), e.details() or ""
        ep = self.endpoints[self._ep_index] if method == "Authenticate" else ",".join(self.endpoints)
        low = details.lower()
        if _transient(e):
            hint = ""
            if any(w in low for w in _TLS_WORDS) or (not self.tls and "socket closed" in low):
                hint = self._tls_hint()
            return EtcdUnavailable(f"etcd {method} on {ep}: {code.name}: {details}{hint}")
        if method == "Authenticate":
            if "authentication failed" in low or "invalid user" in low or code == grpc.StatusCode.INVALID_ARGUMENT:
                return EtcdError(
                    f"etcd at {ep} refused user {self._user!r}: wrong user name or password ({details}); "
                    f"check {ENV_USER} / {ENV_PASSWORD} (or --etcd-user)"
                )
            if "not enabled" in low:
                return EtcdError(f"etcd at {ep} has auth disabled but a user ({self._user!r}) was given: {details}")
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) or (
            "user name" in low or "permission denied" in low
        ):
            who = f"user {self._user!r}" if self._user is not None else "no user (give --etcd-user / RRL_ETCD_USER)"
            return EtcdError(f"etcd at {ep} refused {method} for {who}: {code.name}: {details}")
        return EtcdError(f"etcd {method} on {ep} failed: {code.name}: {details}")

    def _tls_hint(self) -> str:
        if not self.tls:
            return (
                " -- the server may require TLS: give its CA and a client certificate "
                f"({ENV_CA}, {ENV_CERT}, {ENV_KEY} or --etcd-ca/--etcd-cert/--etcd-key)"
            )
        return (
            " -- TLS handshake failed: check that the CA signed the server's certificate, and that the "
            "client certificate/key are given and signed by a CA the server trusts "
            f"({ENV_CA}, {ENV_CERT}, {ENV_KEY} or --etcd-ca/--etcd-cert/--etcd-key)"
        )

    def _stubs(self) -> tuple[grpc.Channel, tuple[tuple[str, str], ...] | None]:
        with self._lock:
            if self._closed:
                raise EtcdError("store is closed")
            if self._retired:
                self._close_retired_locked()
            channel, md = self._connect_locked(), self._metadata
        if self._user is not None and md is None:
            md = self._login(channel)
        return channel, md

    def _rotate(self, failed: grpc.Channel | None) -> None:
        """Drop a failed channel; move to the next endpoint if there are several.

        The channel is shared: other threads may be making a stub or a call on it right now
        (a lease's keep-alive, a watch, the controller's loop). Closing it under them makes
        grpc raise ValueError, end calls in flight as CANCELLED, or crash the process outright
        (a stub made on a closed channel segfaults grpc 1.85). So it is retired, and closed
        once it is older than any call's deadline; a watch stream on it then reconnects.
        """
        with self._lock:
            if failed is not None and self._channel is failed:
                self._retired.append((time.monotonic(), failed))
                self._channel = None
                self._ep_index = (self._ep_index + 1) % len(self.endpoints)
            self._close_retired_locked()

    def _close_retired_locked(self, grace: float | None = None) -> None:
        grace = max(30.0, 3 * self.timeout) if grace is None else grace
        now = time.monotonic()
        keep = []
        for at, ch in self._retired:
            if now - at >= grace:
                ch.close()
            else:
                keep.append((at, ch))
        self._retired = keep

    def close(self) -> None:
        with self._keepalive_lock:
            if self._keepalive is not None:
                self._keepalive.cancel(EtcdError("store is closed"))
                self._keepalive = None
        with self._lock:
            self._closed = True
            self._close_retired_locked(grace=0.0)
            if self._channel is not None:
                self._channel.close()
                self._channel = None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, stub_cls: Any, method: str, request: Any, *, retry: bool = True, read: bool = True) -> Any:
        """One unary call with deadline; transient failures retried (bounded) if ``retry``.

        DEADLINE_EXCEEDED is only retried for ``read`` calls: for a write it is
        ambiguous (the write may have been applied).
        """

        def once() -> Any:
            for attempt in (0, 1):
                channel, md = self._stubs()
                try:
                    return getattr(stub_cls(channel), method)(request, timeout=self.timeout, metadata=md)
                except ValueError as e:
                    if not closed_under_us(e):
                        raise
                    if attempt == 0:
                        continue  # a concurrent reconnect closed it: once more on the new channel
                    raise EtcdUnavailable(f"etcd {method}: the connection was closed by a reconnect") from e
                except grpc.RpcError as e:
                    if _transient(e):
                        self._rotate(channel)
                    elif attempt == 0 and md is not None and any(t in (e.details() or "") for t in _STALE_TOKEN):
                        self._drop_token(md)  # etcd restarted (or the token expired): log in again, once
                        continue
                    raise self._error(method, e) from e
            raise AssertionError("unreachable")

        if not retry:
            return once()

        def transient(exc: BaseException) -> bool:
            if not isinstance(exc, EtcdUnavailable):
                return False
            cause = exc.__cause__
            if not read and isinstance(cause, grpc.RpcError) and cause.code() != grpc.StatusCode.UNAVAILABLE:
                return False  # a deadline or a cancel in flight: the write may have been applied
            return True

        return tenacity.Retrying(
            retry=tenacity.retry_if_exception(transient),
            stop=tenacity.stop_before_delay(self.retry_window),
            wait=tenacity.wait_random_exponential(multiplier=0.05, max=1.0),
            reraise=True,
        )(once)

    # -- KV ------------------------------------------------------------------

    def get(self, key: str) -> KV | None:
        """The current value of ``key``, or None."""
        resp = self._call(etcdrpc.KVStub, "Range", etcdrpc.RangeRequest(key=_b(key)))
        return KV._from_pb(resp.kvs[0]) if resp.kvs else None

    def range(self, prefix: str, *, revision: int = 0, min_mod_revision: int = 0) -> tuple[list[KV], int]:
        """All keys under ``prefix`` (sorted by key) and the store revision they were read at;
        with ``min_mod_revision``, only those modified at or after it."""
        req = etcdrpc.RangeRequest(
            key=_b(prefix),
            range_end=_prefix_end(_b(prefix)),
            revision=revision,
            min_mod_revision=min_mod_revision,
            sort_order=etcdrpc.RangeRequest.ASCEND,
            sort_target=etcdrpc.RangeRequest.KEY,
        )
        resp = self._call(etcdrpc.KVStub, "Range", req)
        return [KV._from_pb(kv) for kv in resp.kvs], resp.header.revision

    def count(self, prefix: str, *, revision: int = 0) -> int:
        """How many keys are under ``prefix`` (at ``revision``; 0: now)."""
        req = etcdrpc.RangeRequest(key=_b(prefix), range_end=_prefix_end(_b(prefix)), revision=revision,
                                   count_only=True)  # fmt: skip
        return int(self._call(etcdrpc.KVStub, "Range", req).count)

    def keys(self, prefix: str, *, revision: int = 0) -> list[str]:
        """The keys under ``prefix`` (at ``revision``; 0: now), without their values."""
        req = etcdrpc.RangeRequest(key=_b(prefix), range_end=_prefix_end(_b(prefix)), revision=revision,
                                   keys_only=True)  # fmt: skip
        return [kv.key.decode() for kv in self._call(etcdrpc.KVStub, "Range", req).kvs]

    def next_key(self, start: str, end: str) -> str | None:
        """The first key in ``[start, end)`` (keys only, one key read), or None."""
        req = etcdrpc.RangeRequest(key=_b(start), range_end=_b(end), limit=1, keys_only=True)
        resp = self._call(etcdrpc.KVStub, "Range", req)
        return resp.kvs[0].key.decode() if resp.kvs else None

    def put(self, key: str, value: bytes | str, *, lease: int = 0) -> int:
        """Write ``key``; returns the revision of the write. Retried on transient errors
        (a put is idempotent in value)."""
        resp = self._call(etcdrpc.KVStub, "Put", etcdrpc.PutRequest(key=_b(key), value=_b(value), lease=lease))
        return int(resp.header.revision)

    def delete(self, key: str, *, prefix: bool = False) -> int:
        """Delete ``key`` (or every key under it with ``prefix``); returns the count deleted."""
        req = etcdrpc.DeleteRangeRequest(key=_b(key))
        if prefix:
            req.range_end = _prefix_end(_b(key))
        return int(self._call(etcdrpc.KVStub, "DeleteRange", req).deleted)

    def txn(self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()) -> TxnResult:
        """Atomic compare-and-swap. Retried only while etcd is unreachable (UNAVAILABLE:
        the request was not applied); a deadline expiry raises :class:`EtcdUnavailable`
        and the caller must re-read to learn whether it was applied."""
        req = etcdrpc.TxnRequest(
            compare=[c._pb() for c in compares],
            success=[_op_pb(o) for o in success],
            failure=[_op_pb(o) for o in failure],
        )
        resp = self._call(etcdrpc.KVStub, "Txn", req, read=False)
        results: list[Any] = []
        for r in resp.responses:
            kind = r.WhichOneof("response")
            if kind == "response_range":
                results.append([KV._from_pb(kv) for kv in r.response_range.kvs])
            elif kind == "response_delete_range":
                results.append(r.response_delete_range.deleted)
            else:
                results.append(None)
        return TxnResult(bool(resp.succeeded), int(resp.header.revision), results)

    def compact(self, revision: int) -> None:
        self._call(etcdrpc.KVStub, "Compact", etcdrpc.CompactionRequest(revision=revision, physical=True))

    def revision(self) -> int:
        """The current store revision."""
        resp = self._call(etcdrpc.KVStub, "Range", etcdrpc.RangeRequest(key=b"\0", limit=1))
        return int(resp.header.revision)

    def status(self) -> dict[str, Any]:
        """Server version, leader member id and db size of the endpoint in use."""
        r = self._call(etcdrpc.MaintenanceStub, "Status", etcdrpc.StatusRequest())
        return {"version": r.version, "leader": r.leader, "member": r.header.member_id, "db_size": r.dbSize}

    # -- auth (setting up a secured cluster; rrl itself only logs in) --------

    def user_add(self, name: str, password: str) -> None:
        """Create an etcd user."""
        self._call(etcdrpc.AuthStub, "UserAdd", etcdrpc.AuthUserAddRequest(name=name, password=password), read=False)

    def user_grant_role(self, user: str, role: str) -> None:
        """Give ``user`` the role ``role`` (``root`` is built in)."""
        req = etcdrpc.AuthUserGrantRoleRequest(user=user, role=role)
        self._call(etcdrpc.AuthStub, "UserGrantRole", req, read=False)

    def auth_enable(self) -> None:
        """Turn etcd's auth on (needs a ``root`` user with the ``root`` role)."""
        self._call(etcdrpc.AuthStub, "AuthEnable", etcdrpc.AuthEnableRequest(), read=False)

    # -- leases --------------------------------------------------------------

    def lease_grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds (etcd enforces a minimum of about 2 s)."""
        return int(self._call(etcdrpc.LeaseStub, "LeaseGrant", etcdrpc.LeaseGrantRequest(TTL=ttl)).ID)

    def lease_revoke(self, lease_id: int) -> None:
        """Revoke a lease (its keys are deleted). Revoking an unknown lease is not an error."""
        try:
            self._call(etcdrpc.LeaseStub, "LeaseRevoke", etcdrpc.LeaseRevokeRequest(ID=lease_id))
        except EtcdError as e:
            if "not found" not in str(e):
                raise

    def lease_refresh(self, lease_id: int) -> int:
        """One keep-alive; returns the remaining TTL, 0 if the lease is gone. Not retried.

        Sent on the store's one ``LeaseKeepAlive`` stream (opened on first use and again after
        it breaks), so a process holding many leases keeps one stream, not one per refresh.
        Raises :class:`EtcdUnavailable` when the stream breaks or no answer comes within the
        store's timeout (the stream is then cancelled; the next refresh opens a new one)."""
        stream = self._keepalive_stream()
        answer = stream.ask(lease_id)
        if not answer.event.wait(self.timeout):
            stream.cancel(EtcdUnavailable(f"etcd LeaseKeepAlive: no answer within {self.timeout:g}s"))
        if answer.error is not None:
            raise answer.error
        return answer.ttl

    def _keepalive_stream(self) -> _KeepAliveStream:
        """The usable keep-alive stream, opened (with its reader thread) if there is none."""
        with self._keepalive_lock:
            stream = self._keepalive
            if stream is not None and stream.usable():
                return stream
            channel, md = self._stubs()
            try:
                stream = _KeepAliveStream(channel, md)
            except ValueError as e:
                if not closed_under_us(e):
                    raise
                raise EtcdUnavailable("etcd LeaseKeepAlive: the connection was closed by a reconnect") from e
            self._keepalive = stream
            self.keepalive_streams += 1
        threading.Thread(target=self._read_keepalive, args=(stream,), name="etcd-keepalive", daemon=True).start()
        return stream

    def _read_keepalive(self, stream: _KeepAliveStream) -> None:
        """The reader of one keep-alive stream: answers matched to their requests, then its end."""
        error: BaseException
        try:
            for resp in stream.call:
                stream.answer(int(resp.ID), int(resp.TTL))
            error = EtcdUnavailable("etcd LeaseKeepAlive: the stream ended")
        except ValueError as e:  # the channel was closed under the stream (a reconnect, the store's close)
            error = EtcdUnavailable(f"etcd LeaseKeepAlive: the connection was closed ({e})")
        except grpc.RpcError as e:
            if _transient(e):
                self._rotate(stream.channel)
            elif stream.md is not None and any(t in (e.details() or "") for t in _STALE_TOKEN):
                self._drop_token(stream.md)
            error = self._error("LeaseKeepAlive", e)
        except Exception as e:  # noqa: BLE001 - whatever ends the stream fails its waiters, never silently
            error = EtcdUnavailable(f"etcd LeaseKeepAlive: {type(e).__name__}: {e}")
        stream.fail(error)

    def keep_lease(self, ttl: int, on_lost: Callable[[], None] | None = None) -> KeptLease:
        """Grant a lease and keep it alive in a background thread (see :class:`KeptLease`)."""
        from .watch import KeptLease

        return KeptLease(self, ttl, on_lost)

    # -- watch ---------------------------------------------------------------

    def watch_prefix(self, prefix: str, start_revision: int | None = None) -> Watch:
        """Watch every change under ``prefix``.

        With ``start_revision=None`` the watch first lists the prefix (available
        as ``watch.initial``, read at ``watch.initial_revision``) and delivers the
        changes after it. With a revision, delivers every change from it on.
        """
        from .watch import Watch

        return Watch(self, prefix, start_revision)
