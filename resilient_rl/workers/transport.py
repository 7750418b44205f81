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

import math
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
            packed = pack(b)
            if self.store is None:
                refs.append(ray.put(packed))
            else:
                refs.append(ray.get(self.store.put_bucket.remote(version, packed))[0])
            del b, packed
        handle = Published(version, refs, n, size)
        if self.store is None:
            return ray.put(handle)
        return ray.get(self.store.seal.remote(version, handle))[0]

    def fetch(self, handle: Any) -> Iterator[tuple[str, torch.Tensor]]:
        yield from fetch(handle)


Packed = tuple[Any, list[tuple[str, str, list[int], int]]]  # (flat uint8 numpy array, [(name, dtype, shape, offset)])


def pack(bucket: Bucket) -> Packed:
    """A bucket as one flat byte array plus each tensor's place in it: what goes on the wire.

    Pickling a torch view sends its whole storage (a bucket of views into a 64 MiB buffer
    sent 64 MiB whatever it held: seen as the weight store filling Ray's object store at a
    0.3M-parameter model); a numpy view sends only its own bytes, out of band. Tensors that
    are consecutive views of one storage (``TrainCore.buckets``) are packed without a copy;
    any others are copied into a new array."""
    import numpy as np

    if not bucket:
        return np.empty(0, dtype=np.uint8), []
    first = bucket[0][1]
    storage = first.untyped_storage()
    same = all(t.untyped_storage().data_ptr() == storage.data_ptr() and t.is_contiguous() for _, t in bucket)
    entries: list[tuple[str, str, list[int], int]] = []
    if same and first.device.type == "cpu":
        lo = min(t.storage_offset() * t.element_size() for _, t in bucket)
        hi = max((t.storage_offset() + t.numel()) * t.element_size() for _, t in bucket)
        whole = torch.empty(0, dtype=torch.uint8).set_(storage)
        for name, t in bucket:
            entries.append((name, str(t.dtype).removeprefix("torch."), list(t.shape),
                            t.storage_offset() * t.element_size() - lo))  # fmt: skip
        return whole[lo:hi].numpy(), entries
    offsets, off = [], 0
    for _, t in bucket:  # each tensor at a 64-byte boundary: any dtype's view of it is aligned
        offsets.append(off)
        off += -(-(t.numel() * t.element_size()) // 64) * 64
    flat = torch.empty(off, dtype=torch.uint8)
    for (name, t), at in zip(bucket, offsets, strict=True):
        n = t.numel() * t.element_size()
        flat[at : at + n].copy_(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8))
        entries.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), at))
    return flat.numpy(), entries


def unpack(packed: Packed) -> Iterator[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of a packed bucket, as views of its array (read-only when
    it lives in Ray's object store: an engine copies them into its own parameters)."""
    import warnings

    flat, entries = packed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given NumPy array is not writable"
        whole = torch.from_numpy(flat)
    for name, dtype, shape, off in entries:
        dt = getattr(torch, dtype)
        n = math.prod(shape) * torch.empty(0, dtype=dt).element_size()
        yield name, whole[off : off + n].view(dt).view(shape)


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
        packed = ray.get(ref)
        yield from unpack(packed)
        del packed
