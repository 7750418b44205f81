"""One chaos run: start the platform, submit the job, inject the schedule, watch, check, report.

::

    run_scenario(sc)
      ├─ ChaosCluster.start()                 etcd ×1|3, Ray head (+ nodes), controllers
      ├─ jobs.submit(spec)                    t0
      ├─ loop until the job ends / timeout:   monitor sample (state, members, desired, journal)
      │                                       fire due faults (a thread each; at time_s or at step)
      ├─ replay + restore in fresh trainers   invariants 3, 4
      ├─ artefacts.collect → invariants.check_all, measure.*
      ├─ report.write (JSON, Markdown, SVG)
      └─ ChaosCluster.stop()                  always, by PID
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from controller import events as events_mod
from controller import jobs
from controller.store import EtcdError, Store

from ..errors import worker_cause
from . import measure, report
from .artefacts import collect
from .cluster import ChaosCluster
from .faults import Ctx, inject
from .invariants import check_all
from .scenario import Fault, Scenario, job_spec_dict

log = logging.getLogger(__name__)


def _sample(store: Store, job: str, spec: Any, t: float) -> dict[str, Any] | None:
    try:
        rec = jobs.get(store, job)
    except EtcdError:
        return None  # etcd is down (a fault): a gap in the timeline
    desired = {g: int(rec.desired.get(g) or getattr(spec, g).replicas) for g in ("rollout", "trainer")}
    members = {g: sorted(int(i.get("pid", 0)) for i in ms.values()) for g, ms in rec.members.items()}
    return {"t": t, "step": int(rec.state.get("step", 0)), "phase": rec.phase, "members": members, "desired": desired}


class _ShardWatcher:
    """Counts shard files replaced in the journal (a regenerated shard): polls inodes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.seen: dict[str, set[str]] = {}
        self.rewritten = 0

    def poll(self, step: int, ahead: int) -> None:
        for k in range(max(0, step - 2), step + ahead + 3):
            d = self.root / f"step-{k:08d}"
            try:
                names = os.listdir(d)
            except OSError:
                continue
            for n in names:  # shard-{i}-{digest}.json: a second file of one shard is a regeneration
                if not (n.startswith("shard-") and n.endswith(".json")):
                    continue
                key = f"{k}/{n[:10]}"
                files = self.seen.setdefault(key, set())
                if n not in files:
                    if files:
                        self.rewritten += 1
                    files.add(n)


def _due(f: Fault, t_rel: float, step: int) -> bool:
    return (f.at.time_s is not None and t_rel >= f.at.time_s) or (f.at.step is not None and step >= f.at.step)


def run_scenario(
    sc: Scenario, out_dir: Path, scenario_path: str | Path | None = None, progress: Any = print, keep: bool = False
) -> dict[str, Any]:
    """Run one scenario end to end; returns the report (also written under the run folder)."""
    from ..spec import parse_spec

    run_dir = Path(out_dir).resolve() / f"{sc.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    home = run_dir / "home"
    spec_d = job_spec_dict(sc, scenario_path)
    spec_d["checkpoint"] = {**spec_d.get("checkpoint", {}), "dir": str(run_dir / "job")}
    spec = parse_spec(spec_d, f"{scenario_path or sc.name}: job")
    workdir = run_dir / "job"
    schedule = sc.schedule()
    records: list[dict[str, Any]] = [
        {"id": i, "kind": f.kind, "at": f.at.model_dump(exclude_none=True), "status": "pending"}
        for i, f in enumerate(schedule)
    ]
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "scenario.json").write_text(sc.model_dump_json(indent=1))
    cluster = ChaosCluster(home, sc.cluster)
    stop = threading.Event()
    threads: list[threading.Thread] = []
    timeline: list[dict[str, Any]] = []
    t_start = time.time()
    store: Store | None = None
    try:
        progress(f"starting the chaos platform in {home}")
        # the platform's processes (so Ray's workers) inherit it: where reward_hang's flag lives
        os.environ["RRL_CHAOS_DIR"] = str(run_dir)
        cluster.start(snapshot_dir=workdir / "snapshots", journal_dir=workdir / "journal")
        store = Store(cluster.endpoints, timeout=2.0, retry_window=5.0)
        monitor = Store(cluster.endpoints, timeout=1.0, retry_window=0.5)
        ctx = Ctx(cluster, store, spec.name, workdir, stop)
        jobs.submit(
            store, spec.name, spec.to_json(), {"rollout": spec.rollout.replicas, "trainer": spec.trainer.replicas}
        )
        t0 = time.time()
        progress(f"submitted {spec.name} ({spec.steps} steps); {len(schedule)} faults scheduled")
        shards = _ShardWatcher(workdir / "journal")
        pending = list(range(len(schedule)))
        last, phase = None, "PENDING"
        deadline = t0 + sc.timeout_s
        while time.time() < deadline:
            now = time.time()
            s = _sample(monitor, spec.name, spec, now)
            if s is not None:
                phase = s["phase"]
                if (
                    last is None
                    or (s["step"], s["members"], s["phase"]) != (last["step"], last["members"], last["phase"])
                    or now - last["t"] >= 5
                ):
                    timeline.append(s)
                    last = s
                shards.poll(s["step"], spec.async_.max_staleness)
            if phase in jobs.TERMINAL:
                break
            step = last["step"] if last else 0
            for i in [i for i in pending if _due(schedule[i], now - t0, step)]:
                pending.remove(i)
                progress(f"  t+{now - t0:6.1f}s step {step:4d}: injecting {schedule[i].kind}")
                th = threading.Thread(
                    target=inject, args=(ctx, schedule[i], records[i]), name=f"fault-{i}", daemon=True
                )
                th.start()
                threads.append(th)
            time.sleep(0.25)
        for i in pending:
            records[i].update(status="skipped", note=f"not fired: the job ended {phase} first")
        if phase not in jobs.TERMINAL:
            progress(f"timeout: the job is still {phase} after {sc.timeout_s:g}s")
        stop.set()  # end waits and ongoing hangs early: the job is over
        for th in threads:
            th.join(timeout=120)
        progress(f"job ended {phase}; checking invariants")
        rep = _finish(sc, spec, store, cluster, workdir, records, timeline, ctx.damaged, shards.rewritten, progress)
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=30)
        _ray_shutdown()
        if store is not None:
            store.close()
        if not keep:
            cluster.stop()
    rep["run_dir"] = str(run_dir)
    rep["wall_s"] = round(time.time() - t_start, 1)
    report.write(rep, run_dir)
    return rep


def _ray_shutdown() -> None:
    import sys

    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()


def _finish(
    sc: Scenario,
    spec: Any,
    store: Store,
    cluster: ChaosCluster,
    workdir: Path,
    records: list[dict[str, Any]],
    timeline: list[dict[str, Any]],
    damaged: dict[int, float],
    rewritten: int,
    progress: Any,
) -> dict[str, Any]:
    rec = jobs.get(store, spec.name)
    replay = restore = None
    if sc.verify and rec.phase == "SUCCEEDED":
        replay, restore = _replays(spec, rec, cluster, workdir, damaged, progress)
    ends = [r["ended_at"] for r in records if r.get("ended_at")]
    art = collect(
        store, spec.name, workdir, damaged=damaged, replay=replay, restore=restore,
        last_fault_end=max(ends) if ends else None, settle_timeout_s=sc.settle_timeout_s,
    )  # fmt: skip
    results = check_all(art)
    evs = events_mod.read(store, spec.name, limit=100_000)
    metrics = _metrics(workdir, int(rec.state.get("step") or 0))
    commits = measure._commit_times(timeline, metrics)
    starts = sorted(r["injected_at"] for r in records if r.get("injected_at"))
    for r in records:
        t = r.get("injected_at")
        nxt = next((s for s in starts if t is not None and s > t), None)
        r["figures"] = measure.fault_figures(r, evs, timeline, commits, nxt) if t else {}
    per_shard = spec.prompts_per_step * spec.rollout.sampling.n / max(1, _num_shards(spec))
    return {
        "scenario": sc.name,
        "ok": all(r.ok for r in results),
        "job": {
            "id": spec.name,
            "phase": rec.phase,
            "reason": rec.state.get("reason"),
            "steps": spec.steps,
            "step": rec.state.get("step"),
            "started_at": rec.state.get("started_at"),
            "finished_at": rec.state.get("finished_at"),
        },  # fmt: skip
        "faults": records,
        "mttr": measure.summarize([r for r in records if r.get("injected_at")]),
        "goodput": measure.goodput(rec.state, metrics, injections=starts),
        "lost_work": measure.lost_work(evs, per_shard, rewritten),
        "invariants": [r.to_dict() for r in results],
        "events": evs,
        "timeline": timeline,
        "steps": [{"step": m["step"], "time": m["time"], "step_seconds": m.get("step_seconds")} for m in metrics],
    }


def _num_shards(spec: Any) -> int:
    return min(spec.prompts_per_step, spec.rollout.shards_per_step or spec.rollout.replicas)


def _metrics(workdir: Path, committed: int | None = None) -> list[dict[str, Any]]:
    from controller import steplog

    return steplog.read(workdir / "metrics.jsonl", committed)


def _replays(
    spec: Any, rec: Any, cluster: ChaosCluster, workdir: Path, damaged: dict[int, float], progress: Any
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Invariant 3 (journal replay from the initial weights) and 4 (restore the newest intact
    snapshot, replay the rest) in fresh trainers on the run's Ray cluster."""
    from checkpoints.snapshots import SnapshotCorrupt, verify

    from ..verify import replay_digest
    from .replay import restore_digest

    steps = int(rec.state.get("step", 0))
    endpoints = cluster.endpoints
    progress(f"replaying {steps} journal steps in a fresh trainer")
    try:
        replay: dict[str, Any] = {"digest": replay_digest(spec, steps, cluster.ray_address, endpoints), "steps": steps}
    except Exception as e:  # a missing / corrupt journal batch: a failed invariant, not a crash
        cause = worker_cause(e)
        replay = {"error": f"{type(cause).__name__}: {str(cause).strip()[:300]}"}
    restore = None
    # the newest intact snapshot before the end (so some steps are replayed after the restore)
    for cp in sorted(rec.checkpoints, key=lambda c: (c["step"] < steps, c["step"]), reverse=True):
        if cp["step"] in damaged:
            continue
        try:
            verify(cp["uri"])
        except SnapshotCorrupt:
            continue  # invariant 4 reports it; restore the next one
        progress(f"restoring snapshot {cp['step']} and replaying to {steps}")
        try:
            restore = {
                "step": cp["step"],
                "digest": restore_digest(spec, cp["uri"], steps, cluster.ray_address, endpoints),
            }
        except Exception as e:
            cause = worker_cause(e)
            restore = {"step": cp["step"], "error": f"{type(cause).__name__}: {str(cause).strip()[:300]}"}
        break
    return replay, restore
