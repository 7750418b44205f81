"""A watch stream that etcd never confirms is reopened, not waited on forever.

Found in CI: a watch opened just as etcd was stopped sat on the dead channel, unsent and
unfailed, for grpc's connect timeout (it broke 10 s later), so a change made after the
restart was not delivered in time. The stand-in here is a real gRPC server (the etcd Watch
service from etcd's own protos) whose first stream takes the create request and never
answers; the second answers as etcd does. That server is the fake (an outer edge); the
Watch under test is the real one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
from pyetcd import etcdrpc
from pyetcd.etcdrpc import kv_pb2

from controller.store import Store
from resilient_rl.local import free_port


class _Watch(etcdrpc.WatchServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.streams = 0
        self.lock = threading.Lock()

    def Watch(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:  # noqa: N802
        with self.lock:
            self.streams += 1
            n = self.streams
        create = next(requests).create_request
        if n == 1:  # the stuck stream: taken, never answered, until the client gives up on it
            while context.is_active():
                threading.Event().wait(0.05)
            return
        yield etcdrpc.WatchResponse(header=etcdrpc.ResponseHeader(revision=7), created=True)
        kv = kv_pb2.KeyValue(key=create.key + b"/a", value=b"v", mod_revision=create.start_revision)
        yield etcdrpc.WatchResponse(header=etcdrpc.ResponseHeader(revision=7), events=[kv_pb2.Event(kv=kv)])
        while context.is_active():
            threading.Event().wait(0.05)


def test_an_unconfirmed_watch_stream_is_cancelled_and_reopened() -> None:
    servicer = _Watch()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    etcdrpc.add_WatchServicer_to_server(servicer, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    store = Store(f"127.0.0.1:{port}", timeout=0.5)
    w = store.watch_prefix("/p", start_revision=1)
    try:
        ev = w.get(timeout=10)
        assert ev is not None, f"no event: the unconfirmed stream was waited on ({servicer.streams} opened)"
        assert (ev.type, ev.key, ev.value, ev.revision) == ("put", "/p/a", b"v", 1)
        assert servicer.streams == 2 and w.reconnects == 1
    finally:
        w.cancel()
        store.close()
        server.stop(0)
