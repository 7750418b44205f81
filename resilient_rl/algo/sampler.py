"""Stateless prompt sampling and per-sample seeds.

The data cursor *is* the step number: which prompts step ``s`` uses is a pure function of
``(seed, step, per_step, dataset_size)``. Nothing needs to be checkpointed or agreed on: a restarted trainer, a
replacement rollout worker or a resized group recomputes exactly the same prompts for any step.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

import numpy as np

_SEED_BOUND = 2**31  # fits a signed 32-bit int: accepted by torch, vLLM, numpy and random alike


@lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, dataset_size: int) -> np.ndarray:
    """The epoch's shuffle of ``range(dataset_size)``; cached because consecutive steps share an epoch.

    The returned array is shared by the cache: callers must not mutate it.
    """
    perm = np.random.default_rng([seed, epoch]).permutation(dataset_size)
    perm.flags.writeable = False
    return perm


def prompt_indices(seed: int, step: int, per_step: int, dataset_size: int) -> list[int]:
    """Dataset indices of the ``per_step`` prompts of ``step``.

    Global position ``p = step * per_step + j`` (``0 <= j < per_step``) lies in epoch ``e = p // dataset_size``
    and maps to ``permutation(seed, e)[p % dataset_size]`` with
    ``permutation = numpy.random.default_rng([seed, e]).permutation(dataset_size)``.

    Guarantees: deterministic and stateless; every index appears exactly once per epoch, so there are no
    duplicates within an epoch. A step that straddles an epoch boundary (or has ``per_step > dataset_size``) can
    contain the same index twice, once from each epoch.

    Raises ``ValueError`` for a negative ``seed`` or ``step``, or a non-positive ``per_step`` / ``dataset_size``.
    """
    if seed < 0 or step < 0:
        raise ValueError(f"seed and step must be >= 0, got seed={seed}, step={step}")
    if per_step < 1 or dataset_size < 1:
        raise ValueError(
            f"per_step and dataset_size must be >= 1, got per_step={per_step}, dataset_size={dataset_size}"
        )
    out: list[int] = []
    p = step * per_step
    end = p + per_step
    while p < end:
        epoch, offset = divmod(p, dataset_size)
        take = min(end - p, dataset_size - offset)  # the rest of the step, or the rest of this epoch
        out.extend(int(i) for i in _permutation(seed, epoch, dataset_size)[offset : offset + take])
        p += take
    return out


def sample_seed(seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """A stable seed in ``[0, 2**31)`` for sample ``sample_index`` of prompt ``prompt_index`` at ``step``.

    blake2b of the four integers (decimal text, so any Python int works): identical on every machine, Python
    version and process (unlike ``hash()``, which is salted per process), and well mixed across neighbours.
    """
    key = f"{seed},{step},{prompt_index},{sample_index}".encode()
    digest = hashlib.blake2b(key, digest_size=8, person=b"rrl-sample-seed").digest()
    return int.from_bytes(digest, "little") % _SEED_BOUND


def eval_task_seed(seed: int) -> int:
    """The seed a held-out eval task (``spec.eval.task``) is built with: another than the job's,
    so a generated task of the same kind (copy, reverse, arith) holds other prompts."""
    return (seed + 1) % _SEED_BOUND
