"""Moving published weights from the trainer to the rollout engines, bucket by bucket.

One protocol, :class:`WeightTransport`: ``publish`` takes the trainer's weights as an
iterator of *buckets* (lists of ``(name, tensor)`` of about ``trainer.publish_bucket_mb``,
gathered from the ranks one at a time, see ``TrainCore.buckets``) and returns a small
picklable *handle*; ``fetch`` turns a handle back into ``(name, tensor)`` pairs, again one
bucket at a time, which an engine's ``load_weights`` consumes as they come. So neither the
publishing rank nor the loading worker ever holds a second whole copy of the model beside
its own (the approach of slime's bucketed weight update).

:class:`ObjectStoreTransport` is the implementation used here (CPU, any node): each bucket
becomes one Ray object owned by the job's :class:`~.weights.WeightStore` actor (so it
outlives trainer restarts), and the handle is a :class:`Published` listing the bucket
references. A CUDA path (engines on the trainer's GPUs, CUDA IPC handles instead of
copies) belongs behind the same two calls; it is not built yet.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

Bucket = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class Published:
    """One published policy version: its buckets' object references, in name order."""

    version: int
    buckets: list[Any] = field(default_factory=list)
    tensors: int = 0
    bytes: int = 0


class WeightTransport(Protocol):
    def publish(self, version: int, buckets: Iterable[Bucket]) -> Any:
        """Publish ``version`` from its buckets; returns the handle engines fetch it by."""
        ...

    def fetch(self, handle: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights of ``handle`` as ``(name, tensor)`` pairs, one bucket in memory at a time."""
        ...


class ObjectStoreTransport:
    """Buckets as Ray objects owned by ``store`` (a ``WeightStore`` actor handle; None: owned by
    the calling process, for standalone use). ``publish`` returns a reference to the
    :class:`Published` handle, itself owned by the store."""

    def __init__(self, store: Any | None = None) -> None:
        self.store = store

    def publish(self, version: int, buckets: Iterable[Bucket]) -> Any:
        import ray

        refs: list[Any] = []
        n = size = 0
        for b in buckets:
            if not b:
                continue
            n += len(b)
            size += sum(t.numel() * t.element_size() for _, t in b)
            if self.store is None:
                refs.append(ray.put(b))
            else:
                refs.append(ray.get(self.store.put_bucket.remote(version, b))[0])
            del b
        handle = Published(version, refs, n, size)
        if self.store is None:
            return ray.put(handle)
        return ray.get(self.store.seal.remote(version, handle))[0]

    def fetch(self, handle: Any) -> Iterator[tuple[str, torch.Tensor]]:
        yield from fetch(handle)


def fetch(handle: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The pairs of a :class:`Published` handle (Ray resolves the top-level reference the driver
    passes, so a worker gets the handle itself); a plain state dict passes through as it is."""
    if isinstance(handle, dict):
        yield from handle.items()
        return
    import ray

    if not isinstance(handle, Published):
        handle = ray.get(handle)
    for ref in handle.buckets:
        bucket = ray.get(ref)
        yield from bucket
        del bucket
