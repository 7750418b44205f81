"""Restore check for invariant 4: a fresh trainer group restores a committed snapshot and
replays the journal from there to the job's last step; its weights must equal the job's.

The journal replay from the initial weights (invariant 3) is :func:`resilient_rl.verify.replay_digest`.
"""

from __future__ import annotations

from typing import Any

from ..runner import NAMESPACE, job_workdir


def restore_digest(spec: Any, snapshot: str, steps: int, ray_address: str | None, etcd: str) -> str:
    """Digest of the weights after restoring ``snapshot`` and training its step..steps-1.

    Raises whatever the restore raises (wrapped by Ray) if the snapshot cannot be loaded.
    """
    import ray

    from ..trainer import trainer_actor

    if not ray.is_initialized():
        ray.init(address=ray_address, namespace=NAMESPACE, log_to_driver=False)
    workdir = job_workdir(spec)
    model_dir = spec.model.path or str(workdir / "model")
    world = spec.trainer.replicas
    member_job = f"restore-{spec.name}"[:63].rstrip("-")
    cls = trainer_actor()
    ranks: list[Any] = [
        cls.options(num_cpus=spec.trainer.num_cpus).remote(
            member_job, r, world, spec.to_json(), model_dir, str(workdir), etcd
        )
        for r in range(world)
    ]
    try:
        master = ray.get(ranks[0].address.remote())
        start = ray.get([r.setup.remote(master, snapshot) for r in ranks])[0]["step"]
        for j in range(int(start), steps):
            ray.get([r.train_step.remote(j, False) for r in ranks])
        return str(ray.get(ranks[0].digest.remote()))
    finally:
        for r in ranks:
            try:
                ray.get(r.shutdown.remote(), timeout=10)
            except Exception:  # the kill below is what matters
                pass
            ray.kill(r)
