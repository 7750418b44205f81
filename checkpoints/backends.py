"""Async snapshot backends: one interface, two engines (DCP and torchsnapshot).

The state contract (both backends)::

    state = {"model": {...tensors...}, "optim": {...}, "extra": {...small JSON-able...}}

``state`` is a tree of ``dict`` (``str`` or ``int`` keys), ``list`` and ``tuple`` whose
leaves are tensors or JSON scalars (``None``, ``bool``, ``int``, ``float``, ``str``).
Tensors go through the engine; the non-tensor leaves (and the tree's shape) are written
as one JSON string inside the same snapshot, so nothing is unpickled on load
(torchsnapshot's objects fail under torch's ``weights_only`` default, and a pickle in a
snapshot is a code-execution hazard).

Build ``state`` with :func:`training_state`, apply a loaded one with
:func:`apply_training_state`: they use ``torch.distributed.checkpoint.state_dict``, so
model and optimizer state are keyed by parameter FQN (DDP's ``module.`` stripped) and an
optimizer that never stepped gets state tensors to load into. State is replicated (DDP):
every rank saves the same values, each engine writes them once, any world size loads them.

Collectives run on a dedicated gloo group (created on first use, itself a collective over
the default group): DCP's background thread issues collectives, and sharing the training
group with DDP's all-reduces from the main thread could order them differently on
different ranks. Without an initialized process group the backends work single-process.
"""

from __future__ import annotations

import json
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from checkpoints.snapshots import MANIFEST

PG = dist.ProcessGroup | None  # None: single process, no group
Done = Callable[[], bool]  # has the background write finished? (never blocks)
Wait = Callable[[], object]  # block until it has; raise what it raised
OBJECTS_KEY = "__objects__"  # the flat key holding the JSON tree of non-tensor leaves
BACKENDS = ("dcp", "torchsnapshot")

# DCP warns on every single-process save/load; that mode is intended here (no group).
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
# DCP's CheckpointException (every rank's failures, gathered) derives from BaseException
_ENGINE_ERRORS = (Exception, CheckpointException)


class SnapshotError(Exception):
    """A snapshot could not be written or loaded (I/O error, missing or mismatched state)."""


def _describe(e: BaseException) -> str:
    """One line per failing rank (engines put whole tracebacks in messages; see ``__cause__``)."""
    if isinstance(e, CheckpointException):
        return "; ".join(f"rank {r}: {type(x).__name__}: {x}" for r, (x, _) in sorted(e.failures.items()))
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1].strip() if lines else ''}"


class PendingSnapshot:
    """A snapshot being written in the background; returned by :meth:`SnapshotBackend.async_save`.

    ``blocking_s`` is how long ``async_save`` blocked its caller (mostly the
    staging copy). Once ``async_save`` has returned, the caller may mutate the
    state: what gets written was copied before the return.
    """

    def __init__(
        self, path: Path, blocking_s: float, done: Done, wait: Wait, error: BaseException | None = None
    ) -> None:
        self.path = path
        self.blocking_s = blocking_s
        self._done = done
        self._wait = wait
        self._error: BaseException | None = error
        self._waited = error is not None
        self._lock = threading.Lock()

    def done(self) -> bool:
        """True once the write finished, successfully or not (never blocks)."""
        return self._waited or self._done()

    def wait(self) -> None:
        """Block until this rank's part is written. Raises :class:`SnapshotError` if the write
        failed (ENOSPC, unwritable path, a peer's failure); calling it again repeats the outcome.
        Returning says nothing about durability or completeness: that is
        :func:`checkpoints.snapshots.write_manifest`'s job, after every rank's ``wait``."""
        with self._lock:
            if not self._waited:
                try:
                    self._wait()
                except _ENGINE_ERRORS as e:  # RuntimeError (torchsnapshot), CheckpointException, OSError
                    self._error = e
                self._waited = True
        if self._error is not None:
            if isinstance(self._error, SnapshotError):
                raise self._error
            raise SnapshotError(f"snapshot {self.path}: write failed: {_describe(self._error)}") from self._error


class SnapshotBackend(Protocol):
    """What the trainer needs from a snapshot engine (see the module doc for ``state``)."""

    name: str

    def async_save(self, state: dict[str, Any], path: Path) -> PendingSnapshot:
        """Collective: every rank calls it with its own (replicated) ``state``. Returns once
        ``state`` is copied; the write goes on in the background. Raises RuntimeError if this
        backend's previous snapshot is not done; write errors surface from ``wait()``."""
        ...

    def load(self, state: dict[str, Any], path: Path) -> None:
        """Collective: load the snapshot at ``path`` in place into ``state`` (any saving
        world size). Raises :class:`SnapshotError`."""
        ...

    def prepare(self) -> None:
        """Collective: make the backend's own process group now. Call it on every rank right
        after the default group formed, while every rank is there."""
        ...


# ---------------------------------------------------------------- the state tree


def _flatten(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], str]:
    """Split ``state`` into its tensors (keyed by an escaped path) and a JSON tree of the rest."""
    tensors: dict[str, torch.Tensor] = {}

    def enc(obj: Any, path: tuple[str, ...]) -> Any:
        if isinstance(obj, torch.Tensor):
            key = "/".join(quote(p, safe="") for p in path)
            if key in tensors or key == OBJECTS_KEY:
                raise ValueError(f"state path {key!r} is ambiguous (keys 1 and '1' in one dict?)")
            tensors[key] = obj
            return {"t": key, "shape": list(obj.shape), "dtype": str(obj.dtype).removeprefix("torch.")}
        if isinstance(obj, dict):
            for k in obj:
                if not isinstance(k, str | int) or isinstance(k, bool):
                    raise TypeError(f"state key {k!r} at {'/'.join(path)}: only str and int keys are supported")
            return {"d": [[k, enc(v, (*path, str(k)))] for k, v in obj.items()]}
        if isinstance(obj, list | tuple):
            items = [enc(v, (*path, str(i))) for i, v in enumerate(obj)]
            return {"l" if isinstance(obj, list) else "u": items}
        if obj is None or isinstance(obj, bool | int | float | str):
            return {"v": obj}
        raise TypeError(f"state value at {'/'.join(path)} is a {type(obj).__name__}; only tensors and JSON scalars")

    tree = json.dumps(enc(state, ()))
    return tensors, tree


def _tensors_of(tree: Any) -> dict[str, Any]:
    """Every tensor marker of an encoded tree, by key."""
    if "t" in tree:
        return {tree["t"]: tree}
    children = [v for _, v in tree["d"]] if "d" in tree else tree.get("l", tree.get("u", []))
    return {k: m for c in children for k, m in _tensors_of(c).items()}


def _check_compatible(saved_tree: Any, tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Raise :class:`SnapshotError` unless ``tensors`` (what the caller asks to load) and the
    saved tensors are the same set with the same shapes and dtypes: checked before any byte
    is loaded, because torchsnapshot silently skips requested keys it lacks and allocates
    saved ones nobody asked for."""
    saved = _tensors_of(saved_tree)
    missing, extra = sorted(set(tensors) - set(saved)), sorted(set(saved) - set(tensors))
    if missing or extra:
        raise SnapshotError(f"snapshot {path}: state differs: not in snapshot {missing[:5]}, not in state {extra[:5]}")
    for key, t in tensors.items():
        s = saved[key]
        if list(t.shape) != s["shape"] or str(t.dtype).removeprefix("torch.") != s["dtype"]:
            raise SnapshotError(
                f"snapshot {path}: {key} is {s['dtype']}{s['shape']}, {t.dtype}{list(t.shape)} in state"
            )


def _apply_tree(target: Any, tree: Any) -> Any:
    """The value at this position after a load: tensors stay (already loaded in place),
    containers are updated in place where possible, scalars come from the snapshot."""
    if "t" in tree:
        return target
    if "v" in tree:
        return tree["v"]
    if "d" in tree:
        out = target if isinstance(target, dict) else {}
        for k, v in tree["d"]:
            out[k] = _apply_tree(out.get(k), v)
        return out
    items = tree.get("l", tree.get("u"))
    same = isinstance(target, list | tuple) and len(target) == len(items)
    new = [_apply_tree(t, v) for t, v in zip(target if same else [None] * len(items), items, strict=True)]
    if "u" in tree:
        return tuple(new)
    if same and isinstance(target, list):
        target[:] = new
        return target
    return new


# ---------------------------------------------------------------- engines


class _Backend:
    """Shared parts: the one-in-flight rule, the dedicated group, the state tree."""

    name = "?"

    def __init__(self) -> None:
        self._pending: PendingSnapshot | None = None
        self._world: object | None = None  # the default group our group was made from
        self._pg: PG = None

    def _group(self) -> dist.ProcessGroup | None:
        """The gloo group for snapshot collectives (None single-process). Recreated when the
        default group was re-initialized (an elastic restart in the same process)."""
        if not dist.is_initialized():
            return None
        if self._pg is None or self._world is not dist.group.WORLD:
            self._pg = dist.new_group(backend="gloo")
            self._world = dist.group.WORLD
        return self._pg

    def prepare(self) -> None:
        """Make the snapshot group at once (see :class:`SnapshotBackend`). Made lazily instead,
        by the first snapshot or load, a rank lost before it got there left the others in
        ``new_group`` (a store wait) for the process group's whole timeout."""
        self._group()

    def _check_idle(self) -> None:
        if self._pending is not None and not self._pending.done():
            raise RuntimeError(f"{self.name}: snapshot {self._pending.path} is still in flight; wait() on it first")

    def async_save(self, state: dict[str, Any], path: Path) -> PendingSnapshot:
        self._check_idle()
        path = Path(path)
        if (path / MANIFEST).exists():  # a committed snapshot is immutable; a reused step folder is a bug
            raise FileExistsError(f"snapshot {path} is already committed; snapshot into a fresh folder")
        t0 = time.perf_counter()
        tensors, tree = _flatten(state)  # type errors are the caller's bug: raised here, not deferred
        pg = self._group()
        try:
            done, wait = self._start({**tensors, OBJECTS_KEY: tree}, path, pg)
            self._pending = PendingSnapshot(path, time.perf_counter() - t0, done, wait)
        except _ENGINE_ERRORS as e:  # the synchronous part failed (e.g. cannot create path): report via wait()
            self._pending = PendingSnapshot(path, time.perf_counter() - t0, lambda: True, lambda: None, error=e)
        return self._pending

    def load(self, state: dict[str, Any], path: Path) -> None:
        """Collective. Overwrites every tensor of ``state`` in place and replaces its non-tensor
        leaves (dicts gain saved keys they lack, e.g. ``{"extra": {}}`` comes back filled).
        Raises :class:`SnapshotError` without touching ``state`` if the snapshot is unreadable
        or its tensors differ from ``state``'s in names, shapes or dtypes; an I/O error during
        the tensor load may leave ``state`` partly loaded. Verify the manifest first
        (:func:`checkpoints.snapshots.verify`): this does not check digests."""
        self._check_idle()
        path = Path(path)
        tensors, _ = _flatten(state)
        pg = self._group()
        try:
            saved_tree = json.loads(self._read_objects(path, pg))
        except _ENGINE_ERRORS as e:
            if isinstance(e, SnapshotError):
                raise
            raise SnapshotError(f"snapshot {path}: cannot read: {_describe(e)}") from e
        _check_compatible(saved_tree, tensors, path)
        try:
            self._load_tensors(tensors, path, pg)
        except _ENGINE_ERRORS as e:
            raise SnapshotError(f"snapshot {path}: load failed: {_describe(e)}") from e
        _apply_tree(state, saved_tree)

    # engine hooks: start a write (return its done/wait), read the JSON tree, load tensors in place
    def _start(self, flat: dict[str, Any], path: Path, pg: PG) -> tuple[Done, Wait]:
        raise NotImplementedError

    def _read_objects(self, path: Path, pg: PG) -> str:
        raise NotImplementedError

    def _load_tensors(self, tensors: dict[str, torch.Tensor], path: Path, pg: PG) -> None:
        raise NotImplementedError


class DcpBackend(_Backend):
    """``torch.distributed.checkpoint``: async_save stages a CPU copy, then a thread writes it
    (replicated tensors deduplicated across ranks; every rank's error reaches every rank)."""

    name = "dcp"

    def _start(self, flat: dict[str, Any], path: Path, pg: PG) -> tuple[Done, Wait]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

        res = dcp.async_save(flat, checkpoint_id=str(path), process_group=pg, no_dist=pg is None)
        # a bare Future with the default (synchronous, copying) stager; the response type otherwise
        fut = res.upload_completion if isinstance(res, AsyncSaveResponse) else res
        return fut.done, fut.result

    def _read_objects(self, path: Path, pg: PG) -> str:
        import torch.distributed.checkpoint as dcp

        box: dict[str, Any] = {OBJECTS_KEY: ""}
        dcp.load(box, checkpoint_id=str(path), process_group=pg, no_dist=pg is None)
        return str(box[OBJECTS_KEY])

    def _load_tensors(self, tensors: dict[str, torch.Tensor], path: Path, pg: PG) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load(dict(tensors), checkpoint_id=str(path), process_group=pg, no_dist=pg is None)


class _FlatStateful:
    """torchsnapshot wants Stateful objects; this one loads into the given tensors in place."""

    def __init__(self, flat: dict[str, Any]) -> None:
        self.flat = flat

    def state_dict(self) -> dict[str, Any]:
        return self.flat

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for k, v in sd.items():
            cur = self.flat.get(k)
            if not isinstance(cur, torch.Tensor):
                self.flat[k] = v
            elif v is not cur:  # torchsnapshot usually reads straight into `cur`
                cur.copy_(v)


class TorchSnapshotBackend(_Backend):
    """torchsnapshot: ``async_take`` stages copies (collectives in the caller's thread), a
    thread writes them and commits through a store barrier. A rank whose synchronous part
    fails stops taking part in collectives, so its peers wait up to the group timeout."""

    name = "torchsnapshot"
    _KEY = "state"

    def _start(self, flat: dict[str, Any], path: Path, pg: PG) -> tuple[Done, Wait]:
        from torchsnapshot import Snapshot
        from torchsnapshot.dist_store import get_or_create_store
        from torchsnapshot.pg_wrapper import PGWrapper

        if pg is not None:
            # its commit barrier keeps per-path keys in the default store for good: a retry into
            # the same folder would see the last attempt's arrivals and errors. Each rank clears
            # its own key; async_take's collectives order that before any barrier wait.
            get_or_create_store(PGWrapper(pg)).delete_key(f"torchsnapshot_{path}_{dist.get_rank(pg)}")
        app_state: dict[str, Any] = {self._KEY: _FlatStateful(flat)}
        pending = Snapshot.async_take(str(path), app_state, pg=pg, replicated=["**"])
        return pending.done, pending.wait

    def _read_objects(self, path: Path, pg: PG) -> str:
        from torchsnapshot import Snapshot
        from torchsnapshot.manifest import PrimitiveEntry

        # a replicated str is stored inline in the metadata (rank 0's entry): no data file read
        entry = Snapshot(str(path), pg=pg).metadata.manifest.get(f"0/{self._KEY}/{OBJECTS_KEY}")
        if not isinstance(entry, PrimitiveEntry):
            raise SnapshotError(f"snapshot {path}: no state tree in its metadata (not written by this backend?)")
        return str(entry.get_value())

    def _load_tensors(self, tensors: dict[str, torch.Tensor], path: Path, pg: PG) -> None:
        from torchsnapshot import Snapshot

        flat: dict[str, Any] = {**tensors, OBJECTS_KEY: ""}
        Snapshot(str(path), pg=pg).restore({self._KEY: _FlatStateful(flat)})


def make_backend(name: str = "dcp") -> SnapshotBackend:
    """A fresh backend by name ("dcp" or "torchsnapshot"); raises ValueError for others.
    Keep one per trainer rank: it enforces one snapshot in flight and owns the gloo group."""
    if name == "dcp":
        return DcpBackend()
    if name == "torchsnapshot":
        return TorchSnapshotBackend()
    raise ValueError(f"unknown snapshot backend {name!r}; choose one of {', '.join(BACKENDS)}")


# ---------------------------------------------------------------- model + optimizer


def training_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any] | None = None,
    trainable_only: bool = False,
) -> dict[str, Any]:
    """``{"model", "optim", "extra"}`` for :meth:`SnapshotBackend.async_save` / ``load``.

    Tensors alias the live parameters and optimizer state (no copy: the backend copies).
    An optimizer that never stepped gets zero state allocated by one ``lr=0`` step (torch's
    ``get_state_dict`` does it; parameters do not change), so a fresh model+optimizer can be
    the target of a load. ``extra`` must be JSON-able. ``trainable_only``: the parameters that
    train (LoRA adapters), not the frozen ones (the base model, loaded from its folder).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(ignore_frozen_params=trainable_only)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    return {"model": model_sd, "optim": optim_sd, "extra": dict(extra or {})}


def apply_training_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], trainable_only: bool = False
) -> None:
    """Push a loaded :func:`training_state` into ``model`` and ``optimizer`` (model tensors
    already alias the parameters; the optimizer needs its hyper-parameters and state set)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    options = StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)


def flatten_state(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], str]:
    """``state``'s tensors by escaped path and the JSON tree of the rest (what a backend writes)."""
    return _flatten(state)


def apply_state_tree(state: dict[str, Any], tree: str) -> None:
    """Put the non-tensor leaves of a :func:`flatten_state` tree back into ``state`` (in place)."""
    _apply_tree(state, json.loads(tree))
