"""Read a finished run's artefacts (etcd history, events, journal, checkpoints) into
the plain records :mod:`.invariants` checks.

etcd history: a key that is only ever modified (``state``) is walked back
version by version (``Range(key, revision=mod_revision - 1)``); who led at a
revision is ``Range(leader, revision=r)``. Both need the history not to be
compacted: the harness's own etcd never compacts; against a cluster that does,
the checks that need it report "no evidence" instead of passing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from checkpoints.journal import Journal, JournalCorrupt
from checkpoints.snapshots import SnapshotCorrupt, verify
from controller import jobs, keys
from controller.store import KV, EtcdError, Store

from .invariants import Artefacts, BatchView, CheckpointView, Write


def key_history(store: Store, key: str) -> list[KV]:
    """Every version of ``key`` since it was last created, oldest first. Raises EtcdError
    if a revision was compacted."""
    out: list[KV] = []
    kv = store.get(key)
    while kv is not None:
        out.append(kv)
        if kv.version <= 1:
            break
        kvs, _ = store.range(key, revision=kv.mod_revision - 1)
        kv = next((x for x in kvs if x.key == key), None)
    return out[::-1]


class LeaderAt:
    """Who held the leader key at a revision (cached reads of etcd's history)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._cache: dict[int, tuple[str | None, int]] = {}

    def __call__(self, revision: int) -> tuple[str | None, int]:
        if revision not in self._cache:
            kvs, _ = self.store.range(keys.leader(), revision=revision)
            kv = next((x for x in kvs if x.key == keys.leader()), None)
            self._cache[revision] = (kv.value.decode(), kv.create_revision) if kv else (None, 0)
        return self._cache[revision]


def etcd_writes(store: Store, job: str) -> tuple[list[Write], list[Write], str | None]:
    """``(state writes, event writes, error)`` with the leader of each write's revision."""
    try:
        leader_at = LeaderAt(store)
        states = []
        for kv in key_history(store, keys.state(job)):
            who, token = leader_at(kv.mod_revision)
            states.append(Write(kv.key, kv.mod_revision, json.loads(kv.value), who, token))
        evs = []
        kvs, _ = store.range(keys.events(job))
        for kv in kvs:
            who, token = leader_at(kv.mod_revision)
            evs.append(Write(kv.key, kv.mod_revision, json.loads(kv.value), who, token))
        return states, evs, None
    except EtcdError as e:
        return [], [], f"etcd history unreadable ({e})"


def journal_views(root: Path, steps: int) -> dict[int, BatchView]:
    """Each step's batch as the journal holds it (shards read and digest-checked). Under
    dynamic sampling only round 0's samples (the step's own prompts) are the ones invariant 2
    counts; the extra rounds' shards are read and digest-checked all the same."""
    j = Journal(root)
    out: dict[int, BatchView] = {}
    for k in range(steps):
        try:
            refs = j.batch(k)
        except JournalCorrupt as e:
            out[k] = BatchView(k, True, error=str(e))
            continue
        if refs is None:
            out[k] = BatchView(k, False)
            continue
        samples: list[tuple[int, int, int]] = []
        error = None
        for r in refs:
            try:
                body = j.read_shard(r)
            except JournalCorrupt as e:
                error = str(e)
                break
            if int(body["meta"].get("round") or 0) == 0:
                samples += [(int(s["prompt_index"]), int(s["sample"]), int(s["version"])) for s in body["samples"]]
        out[k] = BatchView(k, True, [r.shard for r in refs], samples, error)
    return out


def expected_prompts(spec: Any, steps: int) -> dict[int, list[int]]:
    from ..algo.sampler import prompt_indices
    from ..algo.tasks import make_task

    size = len(make_task(spec.task, spec.seed))
    return {k: prompt_indices(spec.seed, k, spec.prompts_per_step, size) for k in range(steps)}


def checkpoint_views(
    records: list[dict[str, Any]], damaged: dict[int, float], events: list[dict[str, Any]]
) -> list[CheckpointView]:
    """Verify every recorded checkpoint; ``damaged`` maps a step the harness damaged to when."""
    out = []
    for rec in sorted(records, key=lambda r: r["step"]):
        step = int(rec["step"])
        error = None
        try:
            m = verify(rec["uri"])
            if rec.get("digest") and m.digest != rec["digest"]:
                error = "manifest digest differs from the etcd record"
        except (SnapshotCorrupt, KeyError) as e:
            error = str(e)
        out.append(
            CheckpointView(
                step,
                rec,
                error,
                step in damaged,
                step in damaged and restored_after_damage(step, damaged[step], events),
            )
        )
    return out


def restored_after_damage(step: int, when: float, events: list[dict[str, Any]]) -> bool:
    """Whether a trainer restore after ``when`` (before a newer snapshot was committed) took the
    damaged snapshot of ``step`` without reporting it corrupt.

    A restore picks the newest recorded snapshot at or before its step, which is the damaged
    one until a newer snapshot commits; a correct restore reports ``snapshot_corrupt`` for it.
    """
    from .measure import event_time

    later = sorted((e for e in events if (event_time(e) or 0) >= when), key=lambda e: event_time(e) or 0)
    for e in later:
        if e.get("kind") == "snapshot" and int(e.get("step", -1)) > step:
            return False  # a newer snapshot exists: later restores do not look at this one first
        if e.get("kind") == "snapshot_corrupt" and int(e.get("step", -1)) == step:
            return False
        if e.get("kind") in ("trainer_recovered", "replay"):  # both come after the restore chose
            return True
    return False


def collect(
    store: Store,
    job: str,
    workdir: Path,
    *,
    damaged: dict[int, float] | None = None,
    replay: dict[str, Any] | None = None,
    restore: dict[str, Any] | None = None,
    last_fault_end: float | None = None,
    settle_timeout_s: float = 300.0,
) -> Artefacts:
    """Everything :func:`.invariants.check_all` needs about ``job``."""
    from ..spec import JobSpec

    rec = jobs.get(store, job)
    spec = JobSpec.model_validate(rec.spec)
    states, evs, err = etcd_writes(store, job)
    return Artefacts(
        job=job,
        steps=spec.steps,
        samples_per_prompt=spec.rollout.sampling.n,
        max_staleness=spec.async_.max_staleness,
        final_state=rec.state,
        state_writes=states,
        events=evs,
        batches=journal_views(workdir / "journal", spec.steps),
        expected_prompts=expected_prompts(spec, spec.steps),
        checkpoints=checkpoint_views(rec.checkpoints, damaged or {}, [e.value for e in evs]),
        replay=replay,
        restore=restore,
        last_fault_end=last_fault_end,
        settle_timeout_s=settle_timeout_s,
        history_error=err,
    )
