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
  knows until when it is certainly still valid;
* :meth:`Store.watch_prefix` survives disconnects and etcd restarts by resuming
  from the last delivered revision + 1, and on compaction re-lists the prefix and
  emits the difference, so a consumer never misses or double-sees an event.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import tenacity
from pyetcd import etcdrpc

if TYPE_CHECKING:
    from .watch import KeptLease, Watch

log = logging.getLogger(__name__)

_TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


class EtcdError(Exception):
    """A non-transient etcd error (bad request, permission denied, ...)."""


class EtcdUnavailable(EtcdError):
    """etcd could not be reached within the deadline / retry window."""


def _prefix_end(prefix: bytes) -> bytes:
    """The range_end that selects every key starting with ``prefix``."""
    b = bytearray(prefix)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"


def _b(x: str | bytes) -> bytes:
    return x.encode() if isinstance(x, str) else x


@dataclass(frozen=True)
class KV:
    """One key-value pair as etcd stores it."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def _from_pb(cls, kv: Any) -> KV:
        return cls(
            key=kv.key.decode(),
            value=bytes(kv.value),
            create_revision=kv.create_revision,
            mod_revision=kv.mod_revision,
            version=kv.version,
            lease=kv.lease,
        )


@dataclass(frozen=True)
class WatchEvent:
    """A change under a watched prefix. ``type`` is ``"put"`` or ``"delete"``.

    ``revision`` is the store revision of the change. Events synthesised after a
    compaction carry the revision of the re-list instead.
    """

    type: str
    key: str
    value: bytes
    revision: int


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
        if ":" not in e:
            raise ValueError(f"etcd endpoint {e!r} must be host:port")
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
        self.endpoints = parse_endpoints(endpoints)
        self.timeout = timeout
        self.retry_window = retry_window
        self._creds = None
        if ca_cert:
            with open(ca_cert, "rb") as f:
                ca = f.read()
            ck = open(key, "rb").read() if key else None  # noqa: SIM115
            cc = open(cert, "rb").read() if cert else None  # noqa: SIM115
            self._creds = grpc.ssl_channel_credentials(ca, ck, cc)
        self._user, self._password = user, password
        self._lock = threading.Lock()
        self._ep_index = random.randrange(len(self.endpoints))
        self._channel: grpc.Channel | None = None
        self._metadata: tuple[tuple[str, str], ...] | None = None
        self._closed = False

    # -- connection management ----------------------------------------------

    @property
    def endpoint(self) -> str:
        return self.endpoints[self._ep_index]

    def _connect_locked(self) -> grpc.Channel:
        if self._channel is None:
            ep = self.endpoints[self._ep_index]
            opts = [("grpc.max_receive_message_length", 64 << 20)]
            if self._creds is not None:
                self._channel = grpc.secure_channel(ep, self._creds, options=opts)
            else:
                self._channel = grpc.insecure_channel(ep, options=opts)
            self._metadata = None
            if self._user is not None:
                stub = etcdrpc.AuthStub(self._channel)
                try:
                    resp = stub.Authenticate(
                        etcdrpc.AuthenticateRequest(name=self._user, password=self._password or ""),
                        timeout=self.timeout,
                    )
                except grpc.RpcError:
                    self._channel.close()
                    self._channel = None
                    raise
                self._metadata = (("token", resp.token),)
        return self._channel

    def _stubs(self) -> tuple[grpc.Channel, tuple[tuple[str, str], ...] | None]:
        with self._lock:
            if self._closed:
                raise EtcdError("store is closed")
            return self._connect_locked(), self._metadata

    def _rotate(self, failed: grpc.Channel | None) -> None:
        """Drop a failed channel; move to the next endpoint if there are several."""
        with self._lock:
            if failed is not None and self._channel is failed:
                self._channel.close()
                self._channel = None
                self._ep_index = (self._ep_index + 1) % len(self.endpoints)

    def close(self) -> None:
        with self._lock:
            self._closed = True
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
            channel, md = self._stubs()
            try:
                return getattr(stub_cls(channel), method)(request, timeout=self.timeout, metadata=md)
            except grpc.RpcError as e:
                code = e.code()
                if code in _TRANSIENT:
                    self._rotate(channel)
                    raise EtcdUnavailable(
                        f"etcd {method} on {','.join(self.endpoints)}: {code.name}: {e.details()}"
                    ) from e
                if code == grpc.StatusCode.UNAUTHENTICATED or code == grpc.StatusCode.PERMISSION_DENIED:
                    raise EtcdError(f"etcd refused {method}: {code.name}: {e.details()}") from e
                raise EtcdError(f"etcd {method} failed: {code.name}: {e.details()}") from e

        if not retry:
            return once()

        def transient(exc: BaseException) -> bool:
            if not isinstance(exc, EtcdUnavailable):
                return False
            cause = exc.__cause__
            if not read and isinstance(cause, grpc.RpcError) and cause.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return False
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

    def range(self, prefix: str, *, revision: int = 0) -> tuple[list[KV], int]:
        """All keys under ``prefix`` (sorted by key) and the store revision they were read at."""
        req = etcdrpc.RangeRequest(
            key=_b(prefix),
            range_end=_prefix_end(_b(prefix)),
            revision=revision,
            sort_order=etcdrpc.RangeRequest.ASCEND,
            sort_target=etcdrpc.RangeRequest.KEY,
        )
        resp = self._call(etcdrpc.KVStub, "Range", req)
        return [KV._from_pb(kv) for kv in resp.kvs], resp.header.revision

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
        """One keep-alive; returns the remaining TTL, 0 if the lease is gone. Not retried."""
        channel, md = self._stubs()
        stub = etcdrpc.LeaseStub(channel)
        try:
            for resp in stub.LeaseKeepAlive(
                iter([etcdrpc.LeaseKeepAliveRequest(ID=lease_id)]), timeout=self.timeout, metadata=md
            ):
                return int(resp.TTL)
        except grpc.RpcError as e:
            if e.code() in _TRANSIENT:
                self._rotate(channel)
                raise EtcdUnavailable(f"etcd lease keep-alive: {e.code().name}") from e
            raise EtcdError(f"etcd lease keep-alive failed: {e.code().name}: {e.details()}") from e
        return 0

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
