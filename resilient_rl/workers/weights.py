"""The weight store: a Ray actor that owns each published policy version's object.

Runs as the detached actor ``rrl:{job}:weights:0`` (:func:`resilient_rl.naming.actor_name`),
started by the trainer group on the Ray head node (``actors._stable_node``).
"""

from __future__ import annotations

from typing import Any


class WeightStore:
    """Owns the published weights of a job (actor ``rrl:{job}:weights:0``, no CPU reserved).

    Ray frees an object when its owner dies. For each bucket of a new version rank 0 asks
    this actor to ``pull`` it, and the store calls rank 0's ``export``: the caller of a method
    owns its return value, so the bucket, written once into the object store by rank 0, is
    this actor's object and survives trainer restarts; a copy of it on this actor's node (a
    no-op on one node) survives the loss of rank 0's node. ``seal`` then makes the version's
    handle. The store never deserializes a bucket (nor imports torch for one). It keeps the
    newest few versions alive for workers still loading them, and the trainer's shadow
    copies (``put_shadow``).
    """

    def __init__(self) -> None:
        self.refs: dict[int, Any] = {}
        self._buckets: dict[int, list[Any]] = {}  # version -> bucket refs the handle names
        # the trainer's shadow copy: source rank -> step -> (meta, tensors, tree, rng), in this
        # process's memory (not the object store: nothing else reads it until a restart)
        self.shadows: dict[int, dict[int, tuple[dict[str, Any], Any, str, Any]]] = {}

    def pull(self, version: int, index: int, source: Any) -> int:
        """Take bucket ``index`` of ``version`` from ``source`` (rank 0, which has it staged, see
        ``transport.ObjectStoreTransport``); returns once it is in the object store of this
        actor's node. Raises what the export raised."""
        import ray

        from .transport import BUCKET_TIMEOUT_S

        export = getattr(source, "export", None)
        if export is not None:
            status, ref = export.options(num_returns=2).remote(version, index)
        else:  # rank 0 shares its process with a rollout worker (workers/colocated.py)
            status, ref = source.run_export.options(num_returns=2).remote("trainer", "export", version, index)
        # the small return value only: the bucket itself stays where rank 0 wrote it
        got = ray.get(status, timeout=BUCKET_TIMEOUT_S)
        if got != index:
            raise RuntimeError(f"rank 0 exported bucket {got} of version {version} for bucket {index}")
        # a copy on this actor's node (the stable one): the bucket's first copy is on rank 0's
        # node, and a bucket that lived only there would die with that node (seen in the node
        # loss test: a rollout worker's load_weights failed, ObjectReconstructionFailedError).
        # On one node the bucket is already here: nothing is copied.
        ray.wait([ref], timeout=BUCKET_TIMEOUT_S, fetch_local=True)
        have = self._buckets.setdefault(version, [])
        if index == 0:
            have.clear()  # a publish of this version started again (the one before died half-way)
        if len(have) != index:
            raise RuntimeError(f"bucket {index} of version {version} arrived after {len(have)} buckets")
        have.append(ref)
        return index

    def seal(self, version: int, buckets: int, tensors: int, nbytes: int) -> list[Any]:
        """The version's handle (its bucket list), kept like a whole state dict."""
        import ray

        from .transport import Published

        refs = self._buckets.get(version, [])
        if len(refs) != buckets:
            raise RuntimeError(f"version {version} is sealed with {buckets} buckets but {len(refs)} arrived")
        self.refs[version] = ray.put(Published(version, list(refs), tensors, nbytes))
        for v in sorted(self.refs)[:-4]:
            del self.refs[v]
        for v in [v for v in self._buckets if v not in self.refs and v != version]:
            del self._buckets[v]  # buckets of dropped versions (or of a publish that died half-way)
        return [self.refs[version]]

    def get(self, version: int) -> list[Any] | None:
        """The reference of ``version`` if still kept (in a list: the caller borrows it)."""
        return [self.refs[version]] if version in self.refs else None

    def put_shadow(self, meta: dict[str, Any], tensors: Any, tree: str, rng: Any) -> int:
        """Keep a rank's shadow copy of step ``meta['step']`` (see ``TrainerRank._shadow``).

        A layout (world, strategy, spec) other than the one held replaces every copy. Per rank
        the copies older than the *previous* complete step are dropped: a rank sends the copy
        of step k+1 before step k is committed, so if it dies in that gap the copy a restart
        can use (at most the committed step) is the one before. So two complete copies per
        rank are held and one arriving, three at most (a bound even if a rank stops sending)."""
        layout = (meta["world"], meta["strategy"], meta["spec_digest"], meta["sources"])
        if any(m["layout"] != layout for parts in self.shadows.values() for m, *_ in parts.values()):
            self.shadows = {}
        meta = {**meta, "layout": layout}
        parts = self.shadows.setdefault(int(meta["rank"]), {})
        parts[int(meta["step"])] = (meta, tensors, tree, rng)
        for s in sorted(parts)[:-3]:
            del parts[s]
        done = self._complete_steps()
        if len(done) >= 2:
            keep = done[-2]
            for parts in self.shadows.values():
                for s in [s for s in parts if s < keep]:
                    del parts[s]
        return int(meta["step"])

    def _complete_steps(self) -> list[int]:
        """The steps every source rank has its copy of, oldest first."""
        sources = {int(r) for r in self.shadows}
        if not sources:
            return []
        meta = next(iter(next(iter(self.shadows.values())).values()))[0]
        if sources != set(range(int(meta["sources"]))):
            return []
        return sorted(set.intersection(*(set(parts) for parts in self.shadows.values())))

    def shadow(self, upto: int | None = None) -> dict[str, Any] | None:
        """The newest step (at most ``upto``, the committed step) every source rank has a
        shadow copy of, and its layout (None: none)."""
        steps = [s for s in self._complete_steps() if upto is None or s <= upto]
        if not steps:
            return None
        meta = next(iter(next(iter(self.shadows.values())).values()))[0]
        return {"step": steps[-1], "world": meta["world"], "strategy": meta["strategy"],
                "spec_digest": meta["spec_digest"], "sources": meta["sources"]}  # fmt: skip

    def shadow_part(self, rank: int, step: int) -> tuple[Any, str, Any]:
        """Rank ``rank``'s shadow copy of ``step``: (tensors, tree, rng). KeyError if not held."""
        _, tensors, tree, rng = self.shadows[rank][step]
        return tensors, tree, rng

    def ping(self) -> bool:
        return True

    def warm(self) -> bool:
        """Import what the first ``pull`` would: Ray loads an actor's class to deserialize a
        handle of it, and the trainer rank's module imports torch (seconds: measured as a first
        publish 2-4 s slower than the next at 0.3M). ``TrainerGroup.start`` sends this without
        waiting, so the store is warm before the job's first step is published."""
        from . import trainer  # noqa: F401

        return True

    def node(self) -> str:
        """The Ray node this store runs on (its loss takes every published version with it)."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def shutdown(self) -> None:
        """Nothing to leave (no membership); the job's end kills this actor."""
