"""Plain types of the etcd adapter, shared by :mod:`controller.store` (connections and single
calls) and :mod:`controller.watch` (keep-alives and watches), so neither imports the other's
privates. Light: no gRPC."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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


def closed_under_us(e: BaseException) -> bool:
    """A call refused before it was sent because another thread's ``Store._rotate`` closed
    the shared channel: grpc raises ValueError for it ("Cannot invoke RPC on closed channel!",
    "Cannot invoke RPC: Channel closed!"), not an RpcError. Nothing reached etcd, so it is
    safe to repeat on a fresh channel, even a write. (A call already in flight when the channel
    closes ends as an RpcError CANCELLED "Channel closed!" instead: see ``Store._call``.)"""
    low = str(e).lower()
    return isinstance(e, ValueError) and ("channel closed" in low or "closed channel" in low)
