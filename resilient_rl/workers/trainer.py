"""The trainer group: M Ray actors forming one torch.distributed group (DDP or FSDP2).

Every rank reads the whole batch B_k from the journal (by reference, digests
verified) and hands it to its :class:`~.train_core.TrainCore`, which holds the model
and optimizer and does the arithmetic (the same for any world size and strategy: see
that module). This actor adds what a rank needs around it: membership, the leader's
fence, snapshots, and publishing the new weights after each step (gathered from the
shards bucket by bucket, through the job's weight store: see ``transport``).

A non-finite loss on any rank rejects the step on every rank (all-reduced
flag): no optimizer step is applied and the caller is told why.

Under fsdp, ``publish``, ``digest`` and ``train_step(publish=True)`` are collectives: the
driver calls them on every rank (rank 0's answer carries the result).
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import ray
import torch
import torch.distributed as dist

from checkpoints.backends import PendingSnapshot, SnapshotError, make_backend
from checkpoints.journal import Journal, atomic_write
from checkpoints.snapshots import snapshot_dir, write_manifest
from controller.membership import Member
from controller.nodeagent import register
from controller.store import Store

from ..naming import NAMESPACE, actor_name
from ..spec import JobSpec
from .fencing import check_fence, exit_superseded
from .logcapture import capture
from .preemption import Preemption
from .train_core import StepRejected, TrainCore, batch_tensors, behaviour_logprobs, warm_sharded, weights_digest
from .transport import ObjectStoreTransport, pack, unpack

__all__ = ["StepRejected", "TrainerRank", "batch_tensors", "behaviour_logprobs", "trainer_actor", "weights_digest"]

log = logging.getLogger(__name__)
T = TypeVar("T")


def _node_id() -> str | None:
    """The Ray node this process runs on (None outside Ray)."""
    if not ray.is_initialized():  # (get_runtime_context would connect to any local cluster)
        return None
    try:
        return str(ray.get_runtime_context().get_node_id())
    except Exception:  # not in a Ray worker
        return None


_RENDEZVOUS_TIMEOUT = timedelta(seconds=120)


def _node_ip() -> str:
    """This process's node IP as Ray knows it (the local platform binds Ray to 127.0.0.1)."""
    if ray.is_initialized():
        return str(ray.util.get_node_ip_address())
    return "127.0.0.1"


def trainer_actor() -> Any:
    """``TrainerRank`` as a Ray actor class, with the ``io`` concurrency group its snapshot
    waits run in (beside training) and the ``control`` group ``adopt`` answers from (a new
    leader must not queue behind a train step that may never end), and the ``export`` group the
    weight store pulls each published bucket from (while the publishing step waits on the
    store). Use this, never a bare ``ray.remote(TrainerRank)``."""
    return ray.remote(concurrency_groups={"io": 1, "control": 1, "export": 1})(TrainerRank)


def _disk_note(path: Path) -> str:
    """Free space where a snapshot failed: torch's writers often hide ENOSPC behind other errors."""
    import shutil

    for p in (path, *path.parents):
        if p.exists():
            free = shutil.disk_usage(p).free
            return f" ({free / 1e6:.1f} MB free on its device{': disk full' if free < (1 << 20) else ''})"
    return ""


def _in_background_thread(build: Callable[[], T]) -> T:
    """``build()`` in a thread of its own at the lowest CPU priority (nice 19; Linux keeps a nice
    value per thread, and any thread may lower its own), and its result: a warm spare's build
    then takes only the CPU the job's ranks leave idle, where it shares a machine with them.
    The thread ends with the build, so nothing that runs after a promotion is slowed."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):  # not Linux: the build runs at the process's priority
            pass
        try:
            out["value"] = build()
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            out["error"] = e

    t = threading.Thread(target=run, name="spare-build", daemon=True)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def _phases(**seconds: float) -> dict[str, float]:
    """Where a recovery call spent its time (seconds, rounded): the driver's event carries them."""
    return {k: round(v, 3) for k, v in seconds.items()}


class TrainerRank:
    """One rank of the trainer group (see module doc)."""

    def __init__(
        self,
        job: str,
        rank: int,
        world: int,
        spec_json: str,
        model_dir: str,
        workdir: str,
        etcd: str,
        strategy: str | None = None,
        spare: int | None = None,
    ) -> None:
        # first: whatever follows is in the job's logs (`rrl logs`), a failing start included
        self.log = capture(workdir, f"trainer-{rank}" if spare is None else f"trainer-spare-{spare}")
        torch.set_num_threads(max(1, int(os.environ.get("RRL_WORKER_THREADS", "1"))))
        torch.use_deterministic_algorithms(True)
        self.spec = JobSpec.model_validate_json(spec_json)
        self.job, self.rank, self.world = job, rank, world
        self.model_dir = model_dir
        self.journal = Journal(os.path.join(workdir, "journal"))
        self.store = Store(etcd, timeout=2.0, retry_window=30.0)
        self.spare = spare  # a warm spare's index until it is promoted (see warm / promote)
        if spare is None:
            self.member = self._register("trainer", str(rank))
        else:
            self.member = self._register("trainer-spare", str(spare), status="warming")
        self.strategy = strategy or self.spec.trainer.strategy  # the spec's, or `rrl scale --strategy`
        self.core: TrainCore | None = None
        self.backend = make_backend(self.spec.checkpoint.backend)
        self._pending: tuple[PendingSnapshot | str, Path, int, float] | None = None
        self.fence = 0  # newest leader token seen (see check_fence)
        self.last: dict[str, Any] | None = None  # the result of the newest train_step
        # the results of the two newest train steps, by step: a leader may dispatch step k+1
        # before it commits step k (runner._committed), so the next leader may find both uncommitted
        self.recent: dict[int, dict[str, Any]] = {}
        self._training: int | None = None  # the step a train_step is working on (read by adopt)
        self._rendezvous: Any = None  # rank 0: the process group's TCPStore, held from address() on
        self._shadow_buf: dict[str, torch.Tensor] = {}  # staging of the shadow copy, reused
        self._shadow_send: threading.Thread | None = None  # the copy being handed to the store
        self.shadow_blocking_s: float | None = None  # what the newest shadow copy cost the step
        # SIGTERM marks preempted_at in membership, so that the leader hands this rank's place over
        # at the next step boundary (JobRunner._hand_over: a warm spare or a new process gets a
        # survivor's state; no fault counted); see .preemption
        self.preemption = Preemption(self._who, self.spec.fault.preempt_grace_s, lambda: self.member,
                                     spare=lambda: self.spare is not None, mark=lambda: self.preemption.fields())  # fmt: skip

    def _who(self) -> str:
        return f"trainer rank {self.rank}" if self.spare is None else f"trainer spare {self.spare}"

    @property
    def preempted_at(self) -> float | None:
        """Wall time of the SIGTERM that asked this rank to leave."""
        return self.preemption.at

    def _register(self, group: str, worker: str, **fields: Any) -> Member:
        return register(self.store, self.job, group, worker, node=self.spec.fault.membership == "node",
                        ttl=self.spec.fault.lease_ttl, world=self.world, ray_node=_node_id(),
                        on_superseded=exit_superseded, log=self.log.path.name if self.log else None,
                        **fields)  # fmt: skip

    def warm(self) -> dict[str, Any]:
        """A spare: build the model and optimizer now, alone (world 1, no process group), so that
        a promotion only joins a group and receives the state. Under fsdp the sharded model is
        built on the group it joins (its mesh): a spare has torch imported and answers, no more.
        Asked again (a new leader takes over the spares a previous one left) a warm spare answers
        at once; a rank refuses."""
        if self.spare is None:
            raise RuntimeError(f"rank {self.rank} is not a spare")
        t0 = time.monotonic()
        if self.core is None:
            self.core = _in_background_thread(self._build_spare)
        self.member.update(status="spare")
        return {"spare": self.spare, "pid": os.getpid(), "seconds": round(time.monotonic() - t0, 3)}

    def _build_spare(self) -> TrainCore | None:
        if self.strategy != "ddp":
            warm_sharded(self.model_dir)
            return None
        core = TrainCore(self.spec, self.model_dir, 0, 1, "ddp", self._device())
        core.materialize()  # the optimizer's state: not built at a promotion (seconds at 100M)
        return core

    def promote(
        self,
        master: tuple[str, int],
        rank: int,
        world: int,
        token: int,
        src: int | None,
        restore: str | None = None,
        shadow: dict[str, int] | None = None,
    ) -> dict[str, Any]:
        """Hot recovery with a warm spare: become rank ``rank`` of ``world`` (its membership key
        too), join the new group at ``master`` with the survivors (which call :meth:`reform`) and
        receive rank ``src``'s state (collective). With no survivor (``src`` None: world 1, or
        fsdp, where every rank loads its part of the shadow copy) the state comes from the shadow
        copy or the snapshot, as in :meth:`setup`."""
        check_fence(self.fence, token, "promote")
        if self.spare is None:
            raise RuntimeError(f"rank {self.rank} is not a spare")
        t0 = time.monotonic()
        self.rank, self.world, self.spare = rank, world, None
        if self.log is not None:
            self.log.rename(f"trainer-{rank}")
        old, self.member = self.member, self._register("trainer", str(rank))
        old.close()
        device = self._join_group(master, joining=src is not None or world > 1)  # a survivor hosts it
        t1 = time.monotonic()
        if self.core is None:  # not warmed yet (or fsdp): build it now (collective at world > 1)
            self.core = TrainCore(self.spec, self.model_dir, rank, world, self.strategy, device)
        else:
            self.core.regroup(rank, world)
        t2 = time.monotonic()
        received = self._load_state(restore, shadow, src)
        self.member.update(status="ready", step=self.step, strategy=self.strategy)
        t3 = time.monotonic()
        return {"rank": self.rank, "step": self.step, "pid": os.getpid(), "seconds": t3 - t0,
                "threads": torch.get_num_threads(), "phases": _phases(join=t1 - t0, regroup=t2 - t1, state=t3 - t2,
                                                                      **self._share_stats(src)),
                "fingerprint": received}  # fmt: skip

    def _share_stats(self, src: int | None) -> dict[str, float]:
        """The state transfer's breakdown (``TrainCore.share_state``) when the state came from a peer."""
        if src is None or self.core is None:
            return {}
        return {f"state_{k}": v for k, v in self.core.share_stats.items()}

    def _device(self) -> str:
        backend = self.spec.trainer.backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() and self.spec.trainer.num_gpus > 0 else "gloo"
        return "cuda" if backend == "nccl" else "cpu"

    @ray.method(concurrency_group="control")
    def alive(self) -> int:
        """The driver's liveness probe (the deadline channel's fast half, ``faults.TrainerProbe``):
        answers on the control thread while a train step runs or blocks in a collective; a frozen
        process (SIGSTOPped, a paused VM) does not answer at all."""
        return os.getpid()

    @ray.method(concurrency_group="control")
    def adopt(self, token: int, spec_digest: str) -> dict[str, Any]:
        """A (new) leader takes this rank over: raise the fence, report where the rank is.

        Runs in its own concurrency group, so it answers at once even while a train step
        sent by the previous leader runs (or hangs in a collective whose peer died):
        ``busy`` is then True and ``step`` / ``last`` are not settled; the leader asks
        again until it is False, within its own deadline. The fence is raised first, so
        nothing the old leader sends after this is applied. A snapshot the previous
        leader left in flight is waited for and abandoned (it was never committed; its
        folder is collected as garbage).
        """
        check_fence(self.fence, token, "adopt")
        if spec_digest != self.spec.digest():
            raise ValueError("this rank runs another spec of the job (a leftover of an earlier run)")
        self.fence = token
        if self._pending is not None:
            pending = self._pending[0]
            if not isinstance(pending, str):
                with contextlib.suppress(SnapshotError):
                    pending.wait()
            self._pending = None
        busy = self._training is not None
        last = None
        recent = {} if busy else dict(self.recent)
        if self.last is not None and not busy:
            last = {k: v for k, v in self.last.items() if k != "weights"}
        sketch = self.core.sketch() if self.core is not None and not busy else None
        return {"rank": self.rank, "world": self.world, "step": self.step, "pid": os.getpid(), "last": last,
                "recent": recent, "busy": busy, "strategy": self.strategy, "sketch": sketch}  # fmt: skip

    def address(self, fresh: bool = False) -> tuple[str, int]:
        """Where the process group's rendezvous store listens: this rank's node IP and the port
        of the store it opens *now* and holds until the group is formed (a port found free,
        closed and bound again later could be taken in between). Rank 0 hosts it at a start;
        at a hot recovery (``fresh``) a survivor opens a new one for the new epoch."""
        host = _node_ip()
        if self._rendezvous is None or fresh:
            self._rendezvous = dist.TCPStore(host, 0, self.world, True, timeout=_RENDEZVOUS_TIMEOUT,
                                             wait_for_workers=False)  # fmt: skip
        return host, int(self._rendezvous.port)

    def _join_group(self, master: tuple[str, int], joining: bool = False) -> str:
        """Join the process group whose rendezvous store is at ``master`` (held by this rank if
        it opened it); returns the torch device. A collective that waits on a peer longer than
        ``fault.hang_timeout`` fails, so a survivor of a frozen peer gets its error in bounded
        time (gloo cannot abort a collective); at least 30 s, so that ranks set up at different
        speeds under load still meet in their first collectives."""
        backend = self.spec.trainer.backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() and self.spec.trainer.num_gpus > 0 else "gloo"
        mine = self._rendezvous
        if mine is not None and int(mine.port) == int(master[1]) and _node_ip() == master[0]:
            store = mine  # opened by address(): the port was never let go
        else:  # (at a start, rank 0 without address() hosts it at the port given: standalone use)
            host = mine is None and self.rank == 0 and not joining
            store = dist.TCPStore(master[0], master[1], self.world, host, timeout=_RENDEZVOUS_TIMEOUT,
                                  wait_for_workers=False)  # fmt: skip
        timeout = timedelta(seconds=max(30.0, float(self.spec.fault.hang_timeout)))
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world, timeout=timeout)
        self.backend.prepare()  # the snapshot group too, now that every rank is here
        return "cuda" if backend == "nccl" else "cpu"

    @property
    def step(self) -> int:
        """The steps applied to this rank's weights (the core's count; 0 before setup)."""
        return self.core.step if self.core is not None else 0

    @step.setter
    def step(self, value: int) -> None:
        assert self.core is not None
        self.core.step = value

    def setup(
        self,
        master: tuple[str, int],
        restore: str | None = None,
        shadow: dict[str, int] | None = None,
        peer: int | None = None,
        joining: bool = False,
    ) -> dict[str, Any]:
        """Join the process group, load the initial model, shard it (fsdp) or wrap it (DDP),
        build the optimizer and, with ``restore``, load a committed (verified) snapshot, which
        may come from another world size or strategy, or with ``shadow`` (``{"step", "rank"}``)
        the in-memory shadow copy that rank left in the weight store, or with ``peer`` the state
        of that rank of the group (a newcomer at a hot recovery: the survivors call
        :meth:`reform`). Every rank calls one of them (collective). ``joining``: the rendezvous
        store at ``master`` is another rank's (a hot recovery's), even for rank 0."""
        device = self._join_group(master, joining=peer is not None or joining)
        self.core = TrainCore(self.spec, self.model_dir, self.rank, self.world, self.strategy, device)
        received = self._load_state(restore, shadow, peer)
        self.member.update(status="ready", step=self.step, strategy=self.strategy)
        origin = "a snapshot" if restore else "the shadow copy" if shadow else f"rank {peer}" if peer is not None else (
            "the model folder")  # fmt: skip
        print(f"trainer rank {self.rank} of {self.world} ({self.strategy}) of job {self.job}: ready at step "
              f"{self.step} from {origin} (pid {os.getpid()})", file=sys.stderr, flush=True)  # fmt: skip
        return {
            "rank": self.rank,
            "step": self.step,
            # a collective under fsdp: every rank is in setup, except at a hot recovery (``joining``),
            # where the survivors are in reform and the spares in promote
            "digest": None if joining else self.core.digest(),
            "threads": torch.get_num_threads(),  # part of the arithmetic: the lineage records it
            "strategy": self.strategy,
            "fingerprint": received,  # with ``peer``: the state's fingerprint, hashed as it came
        }

    def reform(
        self, master: tuple[str, int], token: int, src: int | None, shadow: dict[str, int] | None = None
    ) -> dict[str, Any]:
        """Hot recovery, on a survivor: a peer was lost. Leave the broken process group, join the
        new one at ``master`` with the newcomer(s) (which call ``setup(peer=src)``), keep the model,
        optimizer and step, and send rank ``src``'s state to the newcomers (collective). A step
        interrupted by the loss was not applied (its all-reduce failed before the optimizer
        step): the rank is at the committed step, which the leader checked before asking.

        Under fsdp (``shadow``: ``{"step", "rank"}``, ``src`` None) no rank holds the lost one's
        shards: the process stays, its state does not; the sharded model is built again on the
        new mesh and loads this rank's part of the shadow copy, as the newcomers do."""
        check_fence(self.fence, token, "reform")
        assert self.core is not None
        if self._training is not None:
            raise RuntimeError(f"rank {self.rank} is still in train step {self._training}")
        if self._pending is not None:  # a snapshot on the old group: its collectives fail with it
            pending = self._pending[0]
            if not isinstance(pending, str):
                with contextlib.suppress(SnapshotError):
                    pending.wait()
            self._pending = None
        if self._shadow_send is not None:
            self._shadow_send.join(timeout=10)
        t0 = time.monotonic()
        if dist.is_initialized():
            dist.destroy_process_group()
        if shadow is not None:
            self.core = None  # its shards live on the old mesh; the memory is needed for the new one
            gc.collect()
        device = self._join_group(master, joining=True)
        t1 = time.monotonic()
        if shadow is not None:
            self.core = TrainCore(self.spec, self.model_dir, self.rank, self.world, self.strategy, device)
        else:
            self.core.regroup(self.rank, self.world)
            self.core.opt.zero_grad(set_to_none=True)  # the lost step's partial gradients
        t2 = time.monotonic()
        fingerprint = self._load_state(None, shadow, None) if shadow is not None else self.core.share_state(int(src))
        self.member.update(status="ready", step=self.step)
        t3 = time.monotonic()
        return {
            "rank": self.rank,
            "step": self.step,
            "pid": os.getpid(),
            "threads": torch.get_num_threads(),
            "seconds": t3 - t0,
            "phases": _phases(join=t1 - t0, regroup=t2 - t1, state=t3 - t2, **self._share_stats(src)),
            "fingerprint": fingerprint,
        }

    def _load_state(self, restore: str | None, shadow: dict[str, int] | None, peer: int | None) -> str | None:
        """The state a rank starts from: rank ``peer``'s (collective), a snapshot folder, the shadow
        copy (``{"step", "rank"}``) in the weight store, or (none given) the initial model.
        Returns the state's fingerprint when it came from ``peer`` (hashed as it came), else None."""
        assert self.core is not None
        if peer is not None:
            return self.core.share_state(peer)
        if restore is not None:
            self._restore(Path(restore))
        elif shadow is not None:
            store = ray.get_actor(actor_name(self.job, "weights", 0), namespace=NAMESPACE)
            packed, tree, rng = ray.get(store.shadow_part.remote(int(shadow["rank"]), int(shadow["step"])))
            self.core.load_shadow(dict(unpack(packed)), tree)
            torch.set_rng_state(rng)
            if self.step != int(shadow["step"]):
                raise RuntimeError(f"the shadow copy of step {shadow['step']} holds step {self.step}")
        return None

    def fingerprint(self) -> dict[str, Any]:
        """This rank's state fingerprint (model, optimizer, step, RNG; see TrainCore.fingerprint)."""
        assert self.core is not None
        return {"rank": self.rank, "step": self.step, "pid": os.getpid(), "fingerprint": self.core.fingerprint()}

    def _restore(self, path: Path) -> None:
        assert self.core is not None
        state = self.core.training_state()
        self.backend.load(state, path)  # reshards: the snapshot may come from another world size or strategy
        self.core.apply_state(state)
        rng = path / f"rng-rank{self.rank}.pt"
        if not rng.exists():
            rng = path / "rng-rank0.pt"  # a different world size: ranks share rank 0's stream
        torch.set_rng_state(torch.load(rng, weights_only=True))

    # -- snapshots (see checkpoints/) ------------------------------------------

    def snapshot(self, root: str, token: int = 0) -> dict[str, Any]:
        """Start an async snapshot of the state after ``self.step`` steps (collective, at a
        step boundary). Returns once the state is staged; the write goes on in the
        background and :meth:`wait_snapshot` reports its outcome. A write error here (disk
        full while writing the RNG file) is reported the same way, never raised."""
        check_fence(self.fence, token, "snapshot")
        if self._pending is not None:
            raise RuntimeError("a snapshot is already in flight")
        path = snapshot_dir(root, self.step)
        t0 = time.monotonic()
        self.member.update(status="snapshotting")  # the staging part (the write goes on in the background)
        extra = {"step": self.step, "world": self.world, "spec_digest": self.spec.digest()}
        try:
            buf = io.BytesIO()
            torch.save(torch.get_rng_state(), buf)
            path.mkdir(parents=True, exist_ok=True)
            atomic_write(path / f"rng-rank{self.rank}.pt", buf.getvalue())
            assert self.core is not None
            extra["strategy"] = self.strategy
            pending: PendingSnapshot | str = self.backend.async_save(self.core.training_state(extra), path)
        except (OSError, SnapshotError) as e:
            pending = f"{type(e).__name__}: {e}"
        self._pending = (pending, path, self.step, t0)
        self.member.update(status="ready")
        return {"rank": self.rank, "step": self.step, "blocking_s": time.monotonic() - t0}

    @ray.method(concurrency_group="io")
    def wait_snapshot(self) -> dict[str, Any]:
        """Wait for this rank's write (runs beside training). ``ok`` False with the error
        (e.g. disk full) if it failed; the snapshot then never becomes visible."""
        if self._pending is None:
            return {"ok": False, "error": "no snapshot in flight"}
        pending, path, step, t0 = self._pending
        try:
            if isinstance(pending, str):
                return {"ok": False, "rank": self.rank, "step": step, "error": pending + _disk_note(path)}
            pending.wait()
            return {"ok": True, "rank": self.rank, "step": step, "total_s": time.monotonic() - t0}
        except SnapshotError as e:
            return {"ok": False, "rank": self.rank, "step": step, "error": f"{e}{_disk_note(path)}"}
        finally:
            self._pending = None

    @ray.method(concurrency_group="io")
    def commit_snapshot(self, root: str, step: int, meta: dict[str, Any]) -> dict[str, Any]:
        """Rank 0, after every rank's write succeeded: fsync + digest every file and write
        the manifest last. Returns what the leader records in etcd."""
        m = write_manifest(snapshot_dir(root, step), {**meta, "step": step, "world": self.world})
        return {"step": step, "uri": str(m.path), "digest": m.digest, "bytes": m.bytes}

    def publish(self) -> dict[str, Any]:
        """Publish the current weights (policy version = ``self.step``); rank 0's answer carries
        the handle. A collective under fsdp: call it on every rank."""
        return {"step": self.step, "weights": self._put_weights()}

    def _put_weights(self) -> Any:
        """Publish the weights once, bucket by bucket; returns the handle's reference on rank 0.

        The buckets and the handle are put by the job's weight store actor
        (``rrl:{job}:weights:0``), so they are *owned* by an actor that outlives trainer
        restarts: objects owned by this rank would die with it while rollout workers are
        still loading them. Without a weight store (standalone use) this rank owns them.
        """
        assert self.core is not None
        buckets = self.core.buckets(self.spec.trainer.publish_bucket_mb << 20)
        if self.rank != 0:
            if self.strategy == "fsdp":
                for _ in buckets:  # the gathers are collectives: take part, keep nothing
                    pass
            return None
        try:
            store = ray.get_actor(actor_name(self.job, "weights", 0), namespace=NAMESPACE)
        except ValueError:
            store = None
        self._transport = ObjectStoreTransport(store, ray.get_runtime_context().current_actor if store else None)
        return self._transport.publish(self.step, buckets)

    @ray.method(concurrency_group="export")
    def export(self, version: int, index: int) -> tuple[int, Any]:
        """The bucket rank 0 has staged for the weight store's pull (see ``_put_weights``);
        called by the store, which so owns the one serialization of it."""
        transport = getattr(self, "_transport", None)
        if transport is None:
            raise RuntimeError(f"nothing is being published here (bucket {index} of version {version} asked)")
        return transport.export(version, index)  # type: ignore[no-any-return]

    def digest(self) -> str | None:
        """The weights' digest on rank 0 (None on the others). A collective under fsdp."""
        assert self.core is not None
        if self.rank != 0 and self.strategy != "fsdp":
            return None
        return self.core.digest()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole weights on rank 0 (empty on the others). A collective under fsdp."""
        assert self.core is not None
        return self.core.full_state()

    def train_step(self, step: int, publish: bool = True, token: int = 0) -> dict[str, Any]:
        """Train on the complete journal batch of ``step``; returns metrics.

        Rank 0's result carries ``weights`` (a reference to the published handle of
        policy version ``step + 1``) when ``publish``. Raises :class:`StepRejected` on
        every rank if any rank saw a non-finite loss.
        """
        check_fence(self.fence, token, f"train step {step}")
        if step != self.step:
            raise RuntimeError(f"rank {self.rank} is at step {self.step}, asked to train step {step}")
        self._training = step
        self.member.update(status="training")  # the page's worker timeline (membership's status)
        try:
            return self._train_step(step, publish)
        except StepRejected as e:  # the job fails with it: the rank's log says which step and why
            log.error("rank %d: %s", self.rank, e)
            raise
        finally:
            self._training = None
            # one membership write for the step's end: the timeline's status and the step applied
            # (a write of its own after the core's step would be one more put per rank per step)
            self.member.update(status="ready", step=self.step, version=self.step)

    def _train_step(self, step: int, publish: bool) -> dict[str, Any]:
        assert self.core is not None
        t_start = time.time()
        samples = self.journal.read_batch(step)  # the batch order is (shard, position): the same on every rank
        t_read = time.time()
        stats = self.core.train(samples)
        t_trained = time.time()
        send = self._shadow()
        try:
            out: dict[str, Any] = {"rank": self.rank, "step": step, **stats, "shadow_blocking_s": self.shadow_blocking_s,
                                   "sketch": self.core.sketch()}  # fmt: skip
            t_done = time.time()
            if publish:
                weights = self._put_weights()
                if self.rank == 0:
                    out["weights"] = weights
        finally:
            if send is not None:  # behind the publish: its serialisation held the GIL the step's end needs
                send.start()
        if self.rank == 0:  # wall-clock times of the step's parts (the metrics line's trace: where a step goes)
            out["trace"] = {"start": t_start, "read": t_read, "trained": t_trained, "bookkept": t_done,
                            "published": time.time()}  # fmt: skip
        self.last = out
        self.recent[step] = {k: v for k, v in out.items() if k != "weights"}
        for gone in sorted(self.recent)[:-2]:
            del self.recent[gone]
        return out

    def _shadow(self) -> threading.Thread | None:
        """Every ``trainer.shadow_every`` steps: copy this rank's part of the state into
        staging buffers (the only part that blocks the step); returns the thread, not yet
        started, that hands it to the weight store while training goes on (the caller starts it
        once the step's weights are published: the hand-off serialises the whole state, and
        before the publish it made the step 50-70 ms longer at 1.2M parameters). One copy in
        flight: the next waits for it (it reuses the buffers), at most 10 s, then skips its
        own, so a slow or stuck store cannot hold training. Under ddp only rank 0 copies (the
        state is replicated: any world size restores from it)."""
        every = self.spec.trainer.shadow_every
        self.shadow_blocking_s = None
        if not every or self.step % every or (self.strategy == "ddp" and self.rank != 0) or not ray.is_initialized():
            return None
        try:
            store = ray.get_actor(actor_name(self.job, "weights", 0), namespace=NAMESPACE)
        except ValueError:
            return None  # no weight store (a replay by `rrl verify`, standalone use): no shadow
        assert self.core is not None
        if self._shadow_send is not None:
            self._shadow_send.join(timeout=10)  # the last copy is being handed over: its buffers are in use
            if self._shadow_send.is_alive():
                return None  # the store is that slow: skip this copy rather than hold training longer
        t0 = time.perf_counter()
        tensors, tree = self.core.shadow_state(self._shadow_buf)
        self._shadow_buf = tensors
        rng = torch.get_rng_state()
        self.shadow_blocking_s = time.perf_counter() - t0
        meta = {"rank": self.rank, "step": self.step, "world": self.world, "strategy": self.strategy,
                "spec_digest": self.spec.digest(), "sources": 1 if self.strategy == "ddp" else self.world}  # fmt: skip

        def send() -> None:
            try:  # the call's arguments are serialised here, from the staging buffers: as numpy views
                # (transport.pack), which Ray writes out of band into the object store in one copy, and
                # which the store keeps there unread (a pickled torch tensor is copied twice more)
                ray.get(store.put_shadow.remote(meta, pack(list(tensors.items())), tree, rng), timeout=300)
            except Exception as e:  # the store gone: the next restart uses a snapshot
                log.warning("shadow copy of step %d not kept: %s", meta["step"], e)

        self._shadow_send = threading.Thread(target=send, name="shadow-copy", daemon=True)
        return self._shadow_send

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self._rendezvous = None
        self.member.close()
