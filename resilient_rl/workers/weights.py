"""The weight store: a Ray actor that owns each published policy version's object.

Runs as the detached actor ``rrl:{job}:weights:0`` (:func:`resilient_rl.naming.actor_name`),
started by the trainer group on the controller's node.
"""

from __future__ import annotations

from typing import Any


class WeightStore:
    """Owns the published weights of a job (actor ``rrl:{job}:weights:0``, no CPU reserved).

    Ray frees an object when its owner dies. Rank 0 hands each new state dict to
    this actor, which ``ray.put``s it and so owns it: the weights survive trainer
    restarts. It keeps the newest few versions alive for workers still loading them.
    """

    def __init__(self) -> None:
        self.refs: dict[int, Any] = {}
        self._buckets: dict[int, list[Any]] = {}  # version -> bucket refs the handle names

    def put(self, version: int, state: dict[str, Any]) -> list[Any]:
        import ray

        self.refs[version] = ray.put(state)
        for v in sorted(self.refs)[:-4]:
            del self.refs[v]
        return [self.refs[version]]  # in a list: the caller borrows the reference, we stay owner

    def put_bucket(self, version: int, bucket: list[Any]) -> list[Any]:
        """One bucket of a version being published (see ``transport.ObjectStoreTransport``)."""
        import ray

        ref = ray.put(bucket)
        self._buckets.setdefault(version, []).append(ref)
        return [ref]

    def seal(self, version: int, handle: Any) -> list[Any]:
        """The version's handle (its bucket list), kept like a whole state dict."""
        import ray

        self.refs[version] = ray.put(handle)
        for v in sorted(self.refs)[:-4]:
            del self.refs[v]
        for v in [v for v in self._buckets if v not in self.refs and v != version]:
            del self._buckets[v]  # buckets of dropped versions (or of a publish that died half-way)
        return [self.refs[version]]

    def get(self, version: int) -> list[Any] | None:
        """The reference of ``version`` if still kept (in a list: the caller borrows it)."""
        return [self.refs[version]] if version in self.refs else None

    def ping(self) -> bool:
        return True

    def shutdown(self) -> None:
        """Nothing to leave (no membership); the job's end kills this actor."""
