"""Replay verification: retrain from the initial weights on the committed journal.

``rrl verify JOB`` (and the chaos harness) start a fresh trainer group of the
job's world size, train it on the journaled batches 0..N-1 in order, and compare
the final weight digest with the one the job recorded when it finished. Training
is deterministic on CPU, so any lost, repeated or altered step, or a tampered
journal file (digest check), shows up as a mismatch or an error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .runner import NAMESPACE, job_workdir
from .spec import JobSpec


def replay_digest(
    spec: JobSpec,
    steps: int,
    ray_address: str | None,
    etcd: str,
    progress: Callable[[int], None] = lambda _: None,
    restore: str | None = None,
) -> str:
    """Digest of the weights after training a fresh group on journal batches 0..steps-1.

    With ``restore`` (a snapshot folder), the group restores it first and trains only
    the batches from the snapshot's step on (the restore check of invariant 4).
    Raises ``checkpoints.journal.JournalCorrupt`` (wrapped by Ray) if a batch is
    missing or a shard does not match its digest, and whatever the restore raises.
    """
    import ray

    from .trainer import trainer_actor

    if not ray.is_initialized():
        ray.init(address=ray_address, namespace=NAMESPACE, log_to_driver=False)
    workdir = job_workdir(spec)
    model_dir = spec.model.path or str(workdir / "model")
    world = spec.trainer.replicas
    member_job = f"{'restore' if restore else 'verify'}-{spec.name}"[:63].rstrip("-")
    cls = trainer_actor()
    ranks: list[Any] = [
        cls.options(num_cpus=spec.trainer.num_cpus).remote(
            member_job, r, world, spec.to_json(), model_dir, str(workdir), etcd
        )
        for r in range(world)
    ]
    try:
        master = ray.get(ranks[0].address.remote())
        start = int(ray.get([r.setup.remote(master, restore) for r in ranks])[0]["step"])
        for j in range(start, steps):
            ray.get([r.train_step.remote(j, False) for r in ranks])
            progress(j + 1)
        return str(ray.get(ranks[0].digest.remote()))
    finally:
        for r in ranks:
            try:
                ray.get(r.shutdown.remote(), timeout=10)
            except Exception:  # the kill below is what matters
                pass
            ray.kill(r)
