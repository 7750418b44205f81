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
references. The store *pulls* each bucket: the publishing rank stages it (views of its
tensors, no copy) and asks the store to take it; the store calls the rank's ``export``, and a
method's return value is owned by its caller, so the one serialization of the bucket (the
rank writing the views' bytes into the object store) is already the store's object
(``ray.put(_owner=...)`` is gone from Ray 2.56). A worker maps the bucket from shared memory
and its engine copies it into its parameters: two passes over the weights in all. A CUDA
path (engines on the trainer's GPUs, CUDA IPC handles instead of copies) belongs behind
the same two calls; it is not built yet.

This module imports torch only where it packs or unpacks, so the weight store (which only
holds references and builds :class:`Published` handles) never imports it: a fresh store
answers its first publish as fast as the others.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    Bucket = list[tuple[str, torch.Tensor]]

#: Seconds a publish waits for the store to take one bucket, and the store for rank 0's export
#: (a bucket of ``publish_bucket_mb`` crosses in well under a second; a stopped process never
#: answers, and the step that publishes then fails instead of hanging).
BUCKET_TIMEOUT_S = 300.0


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
    :class:`Published` handle, itself owned by the store.

    With a store, ``source`` is the handle of the actor this transport lives in, whose
    ``export(version, index)`` method must answer :meth:`export` (from a concurrency group of
    its own: the publishing thread waits on the store meanwhile). A staged bucket holds views
    of the caller's tensors, which must not change until ``publish`` returns."""

    def __init__(self, store: Any | None = None, source: Any | None = None) -> None:
        if store is not None and source is None:
            raise ValueError("a transport through a weight store needs the source actor the store pulls from")
        self.store, self.source = store, source
        self.staged: tuple[int, int, Packed] | None = None

    def publish(self, version: int, buckets: Iterable[Bucket]) -> Any:
        import ray

        refs: list[Any] = []
        n = size = index = 0
        for b in buckets:
            if not b:
                continue
            n += len(b)
            size += sum(t.numel() * t.element_size() for _, t in b)
            packed = pack(b)
            if self.store is None:
                refs.append(ray.put(packed))
            else:
                self.staged = (version, index, packed)
                try:  # returns once the bucket is in the object store: the views may change after
                    ray.get(self.store.pull.remote(version, index, self.source), timeout=BUCKET_TIMEOUT_S)
                finally:
                    self.staged = None
            index += 1
            del b, packed
        if self.store is None:
            return ray.put(Published(version, refs, n, size))
        return ray.get(self.store.seal.remote(version, index, n, size), timeout=BUCKET_TIMEOUT_S)[0]

    def export(self, version: int, index: int) -> tuple[int, Packed]:
        """The staged bucket, for the store's pull: ``(index, bucket)`` (two return values, so
        the store learns of an error from the small one without fetching the bucket)."""
        staged = self.staged
        if staged is None or staged[:2] != (version, index):
            have = "nothing" if staged is None else f"bucket {staged[1]} of version {staged[0]}"
            raise RuntimeError(f"bucket {index} of version {version} is not staged here ({have} is)")
        return index, staged[2]

    def fetch(self, handle: Any) -> Iterator[tuple[str, torch.Tensor]]:
        yield from fetch(handle)


Packed = list[tuple[str, str, list[int], Any]]  # [(name, dtype, shape, uint8 numpy array of its bytes)]


def pack(bucket: Bucket) -> Packed:
    """A bucket as each tensor's bytes (a uint8 numpy *view* of it: no copy) plus its name,
    dtype and shape: what goes on the wire.

    Pickling a torch view sends its whole storage (a bucket of views into a 64 MiB buffer
    sent 64 MiB whatever it held: seen as the weight store filling Ray's object store at a
    0.3M-parameter model); a numpy view sends only its own bytes, and Ray writes them out of
    band, straight into the object store. Only a tensor that is not a contiguous CPU tensor
    is copied (to CPU, contiguous) first."""
    import torch

    out: Packed = []
    for name, t in bucket:
        t = t.detach()
        if t.device.type != "cpu" or not t.is_contiguous():
            t = t.cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        out.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), raw.numpy()))
    return out


def unpack(packed: Packed) -> Iterator[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of a packed bucket, as views of its arrays (read-only when
    they live in Ray's object store: an engine copies them into its own parameters)."""
    import warnings

    import torch

    for name, dtype, shape, raw in packed:
        dt = getattr(torch, dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "the given NumPy array is not writable"
            flat = torch.from_numpy(raw)
        if flat.numel() == 0:
            yield name, torch.empty(shape, dtype=dt)
            continue
        yield name, flat.view(dt).view(shape)


def fetch(handle: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The pairs of a :class:`Published` handle (Ray resolves the top-level reference the driver
    passes, so a worker gets the handle itself); a plain state dict passes through as it is."""
    if isinstance(handle, dict):
        yield from handle.items()
        return
    import ray

    if not isinstance(handle, Published):
        handle = ray.get(handle, timeout=BUCKET_TIMEOUT_S)
    for ref in handle.buckets:
        packed = ray.get(ref, timeout=BUCKET_TIMEOUT_S)
        yield from unpack(packed)
        del packed
