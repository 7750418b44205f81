"""Dynamic sampling (DAPO): drop the prompt groups that teach nothing, refill the batch.

A group whose ``n`` samples all got the same reward has advantage 0 for every sample: it
costs a forward and backward and moves nothing (only the KL term, if any). With dynamic
sampling a step generates its ``prompts_per_step`` prompts (round 0), counts the groups
with a spread, and while fewer than ``prompts_per_step`` have one and the extra budget
(``algorithm.dynamic_sampling.max_extra_prompts``) is not spent, generates another round
of extra prompts. The trainer then keeps the first ``prompts_per_step`` groups with a
spread, in journal order (:func:`select_groups`).

Everything here is a pure function of the seed, the step, the round and the rewards in the
journal, so a new leader, a restarted trainer and ``rrl verify`` all agree on which
prompts each round has and which groups the batch keeps:

- extra prompts come from a stream keyed by ``(seed, step, round)`` (:func:`extra_prompt_indices`),
  never from the step cursor, so later steps' prompts do not shift;
- a round's size depends only on the counts of the rounds before it (:func:`next_round`);
- round ``r`` samples with the seeds of sample numbers ``r * n .. r * n + n - 1``
  (:func:`round_sample_number`), so a prompt drawn again in a later round is sampled afresh
  (the same seeds would give the same zero-variance group again).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

_STREAM = 0x0DA90  # keeps the extra stream apart from the epoch permutations ([seed, epoch])


def extra_prompt_indices(seed: int, step: int, round_: int, count: int, dataset_size: int) -> list[int]:
    """``count`` dataset indices for extra round ``round_`` (>= 1) of ``step``: distinct while
    ``count <= dataset_size``, drawn with replacement beyond that. Deterministic."""
    if round_ < 1 or count < 0 or dataset_size < 1:
        raise ValueError(f"round must be >= 1, count >= 0, dataset_size >= 1; got {round_}, {count}, {dataset_size}")
    rng = np.random.default_rng([seed, step, round_, _STREAM])
    if count <= dataset_size:
        return [int(i) for i in rng.permutation(dataset_size)[:count]]
    return [int(i) for i in rng.integers(0, dataset_size, size=count)]


def round_sample_number(round_: int, n: int, sample: int) -> int:
    """The sample number whose seed sample ``sample`` of a round-``round_`` prompt uses."""
    return round_ * n + sample


def varied(rewards: Sequence[float], n: int) -> list[bool]:
    """For each group of ``n`` consecutive rewards: whether they are not all equal."""
    if len(rewards) % n:
        raise ValueError(f"{len(rewards)} rewards do not make groups of {n}")
    return [max(rewards[i : i + n]) != min(rewards[i : i + n]) for i in range(0, len(rewards), n)]


def next_round(per_step: int, kept: int, generated: int, extra_used: int, max_extra: int) -> int:
    """How many extra prompts the next round generates (0: the batch is done).

    ``kept``: groups with a spread so far; ``generated``: prompts so far (all rounds);
    ``extra_used``: extra prompts so far. The round asks for the missing groups divided by
    the keep rate seen so far (all of them while nothing was kept), within the budget."""
    need = per_step - kept
    left = max_extra - extra_used
    if need <= 0 or left <= 0:
        return 0
    # ceil(need / keep rate); while nothing was kept, as many again as generated so far
    want = max(need, generated) if kept == 0 else -(-need * generated // kept)
    return min(left, max(need, want))


def select_groups(samples: list[dict[str, Any]], n: int, keep: int) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The first ``keep`` groups of ``samples`` (groups of ``n`` consecutive samples, journal
    order) whose rewards have a spread; all of the first ``keep`` groups when none has one
    (an all-zero advantage step, as without dynamic sampling, rather than an empty one).
    Returns the kept samples and counts (``groups``, ``kept``, ``dropped``)."""
    flags = varied([float(s["reward"]) for s in samples], n)
    chosen = [g for g, ok in enumerate(flags) if ok][:keep]
    if not chosen:
        chosen = list(range(min(keep, len(flags))))
    out = [s for g in chosen for s in samples[g * n : (g + 1) * n]]
    return out, {"groups": len(flags), "kept": len(chosen), "dropped": len(flags) - len(chosen)}


def overlong_shaping(
    rewards: Sequence[float], lengths: Sequence[int], max_tokens: int, filter_: bool, buffer: int, penalty: float
) -> tuple[list[float], list[bool]]:
    """DAPO's overlong handling, per sample: the rewards the advantages are computed from (a
    response longer than ``max_tokens - buffer`` loses ``penalty * (length - (max_tokens -
    buffer)) / buffer``, at most ``penalty``; ``buffer`` 0: unchanged) and which samples train
    (with ``filter_``, not those ``max_tokens`` long: truncated)."""
    shaped = []
    for r, n in zip(rewards, lengths, strict=True):
        over = n - (max_tokens - buffer)
        shaped.append(float(r) - (penalty * min(over, buffer) / buffer if buffer > 0 and over > 0 else 0.0))
    trains = [not (filter_ and n >= max_tokens) for n in lengths]
    return shaped, trains
