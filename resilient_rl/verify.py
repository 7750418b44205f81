"""Replay verification: retrain from the initial weights on the committed journal.

``rrl verify JOB`` (and the chaos harness) train fresh trainer groups on the journaled
batches 0..N-1 in order and compare the final weight digest with the one the job
recorded when it finished. Training is deterministic on CPU, so any lost, repeated or
altered step, or a tampered journal file (digest check), shows up as a mismatch or an
error.

The job's weights are a chain of *segments*, not one run: every (re)start of the
trainer group (a rank fault, ``rrl scale --trainer``) restored the newest snapshot at
or before step k and replayed from there at its own world size, strategy and thread
count, each of which changes the order of floating-point reductions. The runner
records each segment in etcd (``jobs/{job}/lineage/{k}``); :func:`replay_plan`
follows the chain back from the last segment to the initial weights, and the replay
runs each part at its segment's settings, handing the state over through a snapshot
at the same step the job did. Every transition rrl allows today (DDP at any world
size, any thread count) is then bit-exact; a transition that cannot be (a change of
strategy, once there is more than one) is reported with its tolerance.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .naming import TRAINER_ENV, job_workdir
from .spec import JobSpec


@dataclass(frozen=True)
class Part:
    """Train steps ``start..end-1`` at ``world`` ranks with ``threads`` torch threads each,
    starting from the previous part's state at ``start`` (the initial weights for the first)."""

    start: int
    end: int
    world: int
    threads: int
    strategy: str = "ddp"


def replay_plan(
    segments: list[dict[str, Any]], steps: int, world: int, threads: int, strategy: str = "ddp"
) -> list[Part]:
    """The parts a replay of ``steps`` steps runs, from the job's lineage ``segments``.

    A snapshot at step s was written by the segment live when step s-1 was committed: the
    last one with ``at_step < s``. Following ``from_step`` back from the newest segment gives
    the chain that made the final weights; a segment restarted at the same step as a later
    one never trained live and is not in it. Without lineage (a job older than it, or none
    recorded) the replay is one part at ``world`` / ``threads``.
    """
    segs = sorted((s for s in segments if s["at_step"] <= steps), key=lambda s: s["at_step"])
    parts: list[Part] = []
    end = steps
    seg = segs[-1] if segs else None
    while True:
        if seg is None:  # no record of who made these steps: the spec's settings
            parts.append(Part(0, end, world, threads, strategy))
            break
        start = int(seg["from_step"])
        parts.append(
            Part(start, end, int(seg["world"]), int(seg.get("threads") or threads), seg.get("strategy", "ddp"))
        )
        if start == 0:
            break
        end = start
        seg = next((s for s in reversed(segs) if s["at_step"] < start), None)
    parts.reverse()
    return _merged([p for p in parts if p.end > p.start or p is parts[-1]])


def _merged(parts: list[Part]) -> list[Part]:
    """Adjacent parts at the same settings run as one part: one fresh trainer and no hand-over
    snapshot instead of one per restart (a chaos run restarts its trainer several times).

    That equals the live run because a restore is exact (the chaos harness's invariant 4
    checks it on every run) and, with at most two ranks, a gradient sum does not depend on
    how DDP or FSDP buckets it (a + b == b + a), which a restarted group lays out anew.
    Beyond two ranks the order of a ring's sums follows the buckets, so each segment keeps
    a process of its own there, as it ran."""
    out: list[Part] = []
    for p in parts:
        q = out[-1] if out else None
        if (
            q is not None
            and q.end == p.start
            and (q.world, q.threads, q.strategy) == (p.world, p.threads, p.strategy)
            and p.world <= 2
        ):
            out[-1] = Part(q.start, p.end, p.world, p.threads, p.strategy)
        else:
            out.append(p)
    return out


def replay_digest(
    spec: JobSpec,
    steps: int,
    ray_address: str | None,
    etcd: str,
    progress: Callable[[int], None] = lambda _: None,
    restore: str | None = None,
    segments: list[dict[str, Any]] | None = None,
) -> str:
    """Digest of the weights after replaying journal batches 0..steps-1 through the job's lineage.

    ``segments`` default to the job's lineage read from etcd. With ``restore`` (a snapshot
    folder), the replay restores it first and trains only from the snapshot's step on (the
    restore check of invariant 4), at the settings of the segments after it. Raises
    ``checkpoints.journal.JournalCorrupt`` (wrapped by Ray) if a batch is missing or a shard does
    not match its digest, and whatever the restore raises.
    """
    from .job.actors import connect_ray

    connect_ray(ray_address)
    if segments is None:
        from controller import jobs
        from controller.store import Store

        store = Store(etcd)
        try:
            segments = jobs.lineage(store, spec.name)
        finally:
            store.close()
    parts = replay_plan(segments, steps, spec.trainer.replicas, _default_threads(), spec.trainer.strategy)
    handoff = Path(tempfile.mkdtemp(prefix="rrl-verify-", dir=job_workdir(spec)))
    state = restore
    digest = ""
    try:
        if restore is not None:
            from checkpoints.snapshots import verify

            at = int(verify(restore).meta.get("step", 0))
            parts = [p for p in parts if p.end > at] or parts[-1:]
            parts[0] = Part(at, parts[0].end, parts[0].world, parts[0].threads, parts[0].strategy)
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            digest, state = _run_part(spec, part, state, None if last else handoff, etcd, progress)
        return digest
    finally:
        shutil.rmtree(handoff, ignore_errors=True)


def _default_threads() -> int:
    import os

    return max(1, int(os.environ.get("RRL_WORKER_THREADS", "1")))


def _run_part(
    spec: JobSpec, part: Part, state: str | None, handoff: Path | None, etcd: str, progress: Callable[[int], None]
) -> tuple[str, str | None]:
    """Train ``part`` in a fresh group restored from ``state``; returns the digest and, with
    ``handoff``, the snapshot of the state at ``part.end`` for the next part."""
    import ray

    from .workers.trainer import trainer_actor

    workdir = job_workdir(spec)
    model_dir = spec.model.path or str(workdir / "model")
    member_job = f"verify-{spec.name}"[:63].rstrip("-")
    cls = trainer_actor()
    env = {"env_vars": {**TRAINER_ENV, "RRL_WORKER_THREADS": str(part.threads)}}
    ranks: list[Any] = [
        cls.options(num_cpus=spec.trainer.num_cpus, runtime_env=env).remote(
            member_job, r, part.world, spec.to_json(), model_dir, str(workdir), etcd, part.strategy
        )
        for r in range(part.world)
    ]
    try:
        master = ray.get(ranks[0].address.remote())
        start = int(ray.get([r.setup.remote(master, state) for r in ranks])[0]["step"])
        if start != part.start:
            raise RuntimeError(f"the state handed to the replay of steps {part.start}.. is at step {start}")
        for j in range(start, part.end):
            ray.get([r.train_step.remote(j, False) for r in ranks])
            progress(j + 1)
        digest = str(ray.get([r.digest.remote() for r in ranks])[0])  # a collective under fsdp
        if handoff is None:
            return digest, None
        ray.get([r.snapshot.remote(str(handoff)) for r in ranks])
        results = ray.get([r.wait_snapshot.remote() for r in ranks])
        bad = [x["error"] for x in results if not x["ok"]]
        if bad:
            raise RuntimeError(f"the hand-over snapshot at step {part.end} failed: {bad[0]}")
        meta = {"policy_version": part.end, "spec_digest": spec.digest(), "backend": spec.checkpoint.backend}
        info = ray.get(ranks[0].commit_snapshot.remote(str(handoff), part.end, meta))
        return digest, str(info["uri"])
    finally:
        for r in ranks:
            try:
                ray.get(r.shutdown.remote(), timeout=10)
            except Exception:  # the kill below is what matters
                pass
            ray.kill(r)


def describe_plan(parts: list[Part]) -> list[str]:
    """One line per part, for ``rrl verify``'s output."""
    return [f"steps {p.start}..{p.end - 1} at world {p.world}, {p.threads} thread(s), {p.strategy}" for p in parts]
