"""Fault injectors: each breaks the running platform from the outside.

Signals to PIDs read from etcd (worker membership, controller registrations)
and checked against the chaos platform's own process tree; etcd members
stopped and restarted; snapshot files damaged; a tmpfs filled; Ray nodes
killed; ``desired`` rewritten. Nothing in the production code knows.

Each injector fills the fault's record (``target``, ``injected_at``,
``ended_at``, ``note``) and returns when the fault is over (a hang is
SIGCONTed, an etcd member restarted, the ballast removed). The harness runs each
in its own thread. A target that does not show up within ``wait_s`` makes the
fault ``skipped`` with the reason.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller import jobs, keys
from controller.store import EtcdError, Store

from .cluster import ChaosCluster, start_time
from .scenario import Fault

log = logging.getLogger(__name__)


class Skip(Exception):
    """The fault could not be injected (no target); the message says why."""


@dataclass
class Ctx:
    """What an injector may touch."""

    cluster: ChaosCluster
    store: Store
    job: str
    workdir: Path
    stop: threading.Event
    damaged: dict[int, float] = field(default_factory=dict)  # snapshot step -> when the harness damaged it

    def record(self) -> jobs.JobRecord:
        return jobs.get(self.store, self.job)

    def wait_for(self, fn: Callable[[], Any], timeout: float, what: str) -> Any:
        """Poll ``fn`` until it returns something truthy; raise :class:`Skip` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not self.stop.is_set():
            try:
                got = fn()
            except EtcdError:
                got = None
            if got:
                return got
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        raise Skip(f"no {what} within {timeout:g}s")

    def member(self, group: str, target: int | None, prefer: str = "busy") -> Callable[[], Any]:
        """A finder for a live member of ``group`` (our process, not stopped by us): ``(worker, info)``."""

        def find() -> Any:
            rec = self.record()
            if rec.phase in jobs.TERMINAL:
                raise Skip(f"job ended ({rec.phase}) before a {group} worker could be hit")
            cands = []
            for w, info in rec.members.get(group, {}).items():
                pid = info.get("pid")
                if target is not None and w != str(target):
                    continue
                if not isinstance(pid, int) or not self.cluster.owns(pid) or _stopped(pid):
                    continue
                if info.get("status") in (None, "starting"):
                    continue
                cands.append((info.get("status") != prefer, w, info))
            return min(cands, key=lambda c: (c[0], c[1]))[1:] if cands else None

        return find


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return True


def _resume(ctx: Ctx, pid: int, started: int, group: bool = False) -> None:
    """SIGCONT ``pid`` if it is still the process we stopped."""
    if start_time(pid) == started:
        with contextlib.suppress(ValueError):
            ctx.cluster.signal_pid(pid, signal.SIGCONT, group)


def _sleep(ctx: Ctx, secs: float) -> None:
    ctx.stop.wait(secs)  # a run that is being torn down ends the fault early


# --- workers ------------------------------------------------------------------


def _hit(ctx: Ctx, f: Fault, rec: dict[str, Any], group: str, sig: int, prefer: str = "busy") -> tuple[int, int]:
    """Send ``sig`` to a live worker of ``group``; returns its ``(pid, start time)``.

    A worker can exit between being chosen and being signalled (the driver replaced it): then
    another is chosen, within the same ``wait_s``."""
    deadline = time.monotonic() + f.wait_s
    while True:
        left = max(0.1, deadline - time.monotonic())
        w, info = ctx.wait_for(ctx.member(group, f.target, prefer=prefer), left, f"live {group} worker")
        pid = info["pid"]
        started = start_time(pid)
        rec["target"] = {"group": group, "worker": w, "pid": pid, "status": info.get("status")}
        rec["injected_at"] = time.time()
        if ctx.cluster.signal_pid(pid, sig):
            return pid, started
        if time.monotonic() > deadline:
            raise Skip(f"every {group} worker chosen within {f.wait_s:g}s exited before it could be hit")
        time.sleep(0.1)


def rollout_kill(ctx: Ctx, f: Fault, rec: dict[str, Any]) -> None:
    _hit(ctx, f, rec, "rollout", signal.SIGKILL)
    rec["ended_at"] = rec["injected_at"]


def _stop_for(ctx: Ctx, f: Fault, rec: dict[str, Any], group: str, prefer: str = "busy") -> None:
    """SIGSTOP a live worker of ``group`` for ``duration_s``, then SIGCONT it if it is still the same process."""
    pid, started = _hit(ctx, f, rec, group, signal.SIGSTOP, prefer=prefer)
    try:
        _sleep(ctx, float(f.duration_s or 0))
    finally:
        _resume(ctx, pid, started)
        rec["ended_at"] = time.time()
    rec["note"] = "SIGCONT sent" if start_time(pid) == started else "worker was replaced while stopped"


def rollout_hang(ctx: Ctx, f: Fault, rec: dict[str, Any]) -> None:
    _stop_for(ctx, f, rec, "rollout")


def rollout_slow(ctx: Ctx, f: Fault, rec: dict[str, Any]) -> None:
    w, info = ctx.wait_for(ctx.member("rollout", f.target), f.wait_s, "live rollout worker")
    pid = info["pid"]
    started = start_time(pid)
    rec["target"] = {"group": "rollout", "worker": w, "pid": pid, "duty": f.duty, "period_s": f.period_s}
    rec["injected_at"] = time.time()
    end = time.monotonic() + float(f.duration_s or 0)
    cycles = 0
    try:
        while time.monotonic() < end and not ctx.stop.is_set() and start_time(pid) == started:
            ctx.cluster.signal_pid(pid, signal.SIGSTOP)
            _sleep(ctx, f.period_s * f.duty)
            _resume(ctx, pid, started)
            _sleep(ctx, f.period_s * (1 - f.duty))
            cycles += 1
    finally:
        _resume(ctx, pid, started)
        rec["ended_at"] = time.time()
    rec["note"] = f"{cycles} stop/continue cycles"


def rollout_preempt(ctx: Ctx, f: Fault, rec: dict[str, Any]) -> None:
    """SIGTERM a rollout worker, as a spot node's notice does: it drains (its finished groups kept,
    the rest to others) and is replaced; no fault is counted."""
    _hit(ctx, f, rec, "rollout", signal.SIGTERM)
    rec["ended_at"] = rec["injected_at"]


def trainer_preempt(ctx: Ctx, f: Fault, rec: dict[str, Any]) -> None:
    """SIGTERM a trainer rank: handed over at the next step boundary; no fault is counted."""
    _hit(ctx, f, rec, "trainer", signal.SIGTERM, prefer="ready")
    rec["ended_at"] = rec["injected_at"]


def trainer_kill(ctx: Ctx, f: Fault, rec: dict[str, Any]) -> None:
    _hit(ctx, f, rec, "trainer", signal.SIGKILL, prefer="ready")
    rec["ended_at"] = rec["injected_at"]


def trainer_hang(ctx: Ctx, f: Fault, rec: dict[str, Any]) -> None:
    """SIGSTOP a trainer rank for ``duration_s`` (its step, and its peers in the all-reduce, hang)."""
    _stop_for(ctx, f, rec, "trainer", prefer="ready")


def journal_full(ctx: Ctx, f: Fault, rec: dict[str, Any]) -> None:
    """Fill the journal's tmpfs until the job is PAUSED (or ``wait_s``), keep it full for
    ``duration_s``, then free it: the job must resume by itself, losing nothing."""
    root = ctx.cluster.journal_tmpfs
    if root is None:
        raise Skip("no tmpfs on the journal folder (cluster.journal_tmpfs_mb)")
    ballast = root / ".chaos-ballast"
    rec["target"] = {"path": str(root)}
    rec["injected_at"] = time.time()
    with open(ballast, "wb") as fh, contextlib.suppress(OSError):  # until ENOSPC
        while True:
            fh.write(b"\0" * (1 << 20))
            fh.flush()
    try:
        ctx.wait_for(lambda: ctx.record().phase in ("PAUSED", *jobs.TERMINAL), f.wait_s, "the job to pause")
        rec["note"] = f"job {ctx.record().phase}"
        _sleep(ctx, float(f.duration_s or 0))
    finally:
        with contextlib.suppress(FileNotFoundError):
            ballast.unlink()
        rec["ended_at"] = time.time()


REWARD_HANG_FLAG = "reward-hang"


def reward_hang(ctx: Ctx, f: Fault, rec: dict[str, Any]) -> None:
    """Make the job's reward function hang for ``duration_s``: it must be
    ``resilient_rl.chaos.rewards:copy_credit``, which hangs while this flag file exists."""
    if "resilient_rl.chaos.rewards:" not in str(ctx.record().spec.get("task", {}).get("reward_fn")):
        raise Skip("the job's task.reward_fn is not one of resilient_rl.chaos.rewards")
    flag = Path(os.environ["RRL_CHAOS_DIR"]) / REWARD_HANG_FLAG
    rec["target"] = {"flag": str(flag)}
    rec["injected_at"] = time.time()
    flag.touch()
    try:
        _sleep(ctx, float(f.duration_s or 0))
    finally:
        flag.unlink(missing_ok=True)
        rec["ended_at"] = time.time()


def ray_node_remove(ctx: Ctx, f: Fault, rec: dict[str, Any]) -> None:
    """Kill an extra Ray node (its raylet and every worker on it). Default: the node that
    hosts the most of the job's workers."""
    nodes = ctx.cluster.ray_nodes
    if not nodes:
        raise Skip("no extra Ray node to remove")

    def hosted() -> dict[int, list[int]]:
        by: dict[int, list[int]] = {}
        for _, ms in ctx.record().members.items():
            for info in ms.values():
                pid = info.get("pid")
                n = ctx.cluster.ray_node_of(pid) if isinstance(pid, int) else None
                if n is not None:
                    by.setdefault(n, []).append(pid)
        return by

    if f.target is not None:
        if not 1 <= f.target <= len(nodes):
            raise Skip(f"target {f.target}: there are Ray nodes 1..{len(nodes)}")
        idx = f.target
    else:
        by = hosted()
        idx = max(by, key=lambda n: len(by[n])) if by else len(nodes)
    node = nodes[idx - 1]
    if not node.alive():
        raise Skip(f"Ray node {idx} is already gone")
    rec["target"] = {"ray_node": idx, "pid": node.pid, "worker_pids": hosted().get(idx, [])}
    rec["injected_at"] = time.time()
    node.kill()
    rec["ended_at"] = rec["injected_at"]


def scale(ctx: Ctx, f: Fault, rec: dict[str, Any]) -> None:
    groups = {g: n for g, n in (("rollout", f.rollout), ("trainer", f.trainer)) if n is not None}
    rec["target"] = groups
    rec["injected_at"] = time.time()
    jobs.scale(ctx.store, ctx.job, **groups)
    rec["ended_at"] = rec["injected_at"]


# --- controllers ----------------------------------------------------------------


def _leader_pid(ctx: Ctx) -> Any:
    kv = ctx.store.get(keys.leader())
    if kv is None:
        return None
    cid = kv.value.decode()
    reg = ctx.store.get(keys.controller(cid))
    pid = json.loads(reg.value).get("pid") if reg else None
    if not isinstance(pid, int) or ctx.cluster.controller_by_pid(pid) is None or _stopped(pid):
        return None
    return cid, pid


def leader_kill(ctx: Ctx, f: Fault, rec: dict[str, Any]) -> None:
    """SIGKILL the leader controller's process group, then start a replacement standby."""
    cid, pid = ctx.wait_for(lambda: _leader_pid(ctx), f.wait_s, "leader controller")
    rec["target"] = {"controller": cid, "pid": pid}
    rec["injected_at"] = time.time()
    ctx.cluster.signal_pid(pid, signal.SIGKILL, group=True)
    rec["ended_at"] = rec["injected_at"]
    rec["note"] = f"replacement controller {ctx.cluster.spawn_controller()} started"


def leader_pause(ctx: Ctx, f: Fault, rec: dict[str, Any]) -> None:
    """SIGSTOP the leader controller (past its lease TTL when duration_s > TTL), then SIGCONT."""
    cid, pid = ctx.wait_for(lambda: _leader_pid(ctx), f.wait_s, "leader controller")
    started = start_time(pid)
    rec["target"] = {"controller": cid, "pid": pid, "ttl": ctx.cluster.shape.leader_ttl}
    rec["injected_at"] = time.time()
    ctx.cluster.signal_pid(pid, signal.SIGSTOP, group=True)
    try:
        _sleep(ctx, float(f.duration_s or 0))
    finally:
        _resume(ctx, pid, started, group=True)
        rec["ended_at"] = time.time()


# --- etcd -----------------------------------------------------------------------


def etcd_restart(ctx: Ctx, f: Fault, rec: dict[str, Any]) -> None:
    """Restart every etcd member (SIGTERM, then start on the same data dir and ports)."""
    rec["target"] = {"members": [m.name for m in ctx.cluster.etcd]}
    rec["injected_at"] = time.time()
    for m in ctx.cluster.etcd:
        m.stop()
    _start_all(ctx)
    rec["ended_at"] = time.time()
    rec["note"] = f"down {rec['ended_at'] - rec['injected_at']:.1f}s"


def etcd_outage(ctx: Ctx, f: Fault, rec: dict[str, Any]) -> None:
    """Every etcd member killed (SIGKILL) for duration_s, then started again."""
    rec["target"] = {"members": [m.name for m in ctx.cluster.etcd], "down_s": f.duration_s}
    rec["injected_at"] = time.time()
    for m in ctx.cluster.etcd:
        m.stop(kill=True)
    try:
        _sleep(ctx, float(f.duration_s or 0))
    finally:
        _start_all(ctx)
        rec["ended_at"] = time.time()


def _start_all(ctx: Ctx) -> None:
    threads = [threading.Thread(target=m.start) for m in ctx.cluster.etcd if not m.running]
    for t in threads:  # together: a member of a 3-member cluster waits for its peers
        t.start()
    for t in threads:
        t.join()


def _etcd_leader_index(ctx: Ctx) -> int | None:
    for i, m in enumerate(ctx.cluster.etcd):
        if not m.running:
            continue
        with contextlib.suppress(EtcdError), Store(m.endpoint, timeout=1.0, retry_window=1.0) as s:
            st = s.status()
            if st["leader"] == st["member"]:
                return i
    return None


def etcd_member_kill(ctx: Ctx, f: Fault, rec: dict[str, Any]) -> None:
    """Kill one member of a 3-member cluster (default: the etcd leader) for duration_s."""
    if len(ctx.cluster.etcd) < 3:
        raise Skip("etcd_member_kill needs a 3-member etcd cluster")
    idx = f.target if f.target is not None else _etcd_leader_index(ctx)
    if idx is None or not 0 <= idx < len(ctx.cluster.etcd):
        raise Skip(f"no such etcd member: {idx}")
    m = ctx.cluster.etcd[idx]
    rec["target"] = {"member": m.name, "was_leader": idx == _etcd_leader_index(ctx), "down_s": f.duration_s}
    rec["injected_at"] = time.time()
    m.stop(kill=True)
    try:
        _sleep(ctx, float(f.duration_s or 0))
    finally:
        m.start()
        rec["ended_at"] = time.time()


# --- checkpoints ------------------------------------------------------------------


def snapshot_corrupt(ctx: Ctx, f: Fault, rec: dict[str, Any]) -> None:
    """Flip one byte in the biggest file of the newest committed snapshot; by default also kill
    a trainer rank so that the restore has to detect it and fall back."""

    def newest() -> Any:
        cps = ctx.record().checkpoints
        return max(cps, key=lambda c: c["step"]) if cps else None

    cp = ctx.wait_for(newest, f.wait_s, "committed snapshot")
    folder = Path(cp["uri"])
    files = [p for p in folder.rglob("*") if p.is_file() and p.name != "MANIFEST.json"]
    if not files:
        raise Skip(f"snapshot {folder} has no files")
    victim = max(files, key=lambda p: p.stat().st_size)
    rec["target"] = {"step": cp["step"], "file": str(victim)}
    rec["injected_at"] = time.time()
    ctx.damaged[int(cp["step"])] = rec["injected_at"]
    with open(victim, "r+b") as fh:
        fh.seek(victim.stat().st_size // 2)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0xFF]))
    if f.kill_trainer:
        w, info = ctx.wait_for(ctx.member("trainer", None, prefer="ready"), f.wait_s, "live trainer rank")
        rec["target"]["killed_trainer"] = {"worker": w, "pid": info["pid"]}
        ctx.cluster.signal_pid(info["pid"], signal.SIGKILL)
    rec["ended_at"] = time.time()


def disk_full(ctx: Ctx, f: Fault, rec: dict[str, Any]) -> None:
    """Fill the snapshot tmpfs (leaving 64 KiB) until the next snapshot attempt has failed
    (or ``wait_s``), then free it."""
    root = ctx.cluster.tmpfs
    if root is None:
        raise Skip("no tmpfs on the snapshot folder (cluster.checkpoint_tmpfs_mb)")
    ballast = root / ".chaos-ballast"
    free = os.statvfs(root).f_bavail * os.statvfs(root).f_frsize
    size = max(0, free - (64 << 10))
    rec["target"] = {"path": str(root), "ballast_bytes": size}
    rec["injected_at"] = time.time()
    with open(ballast, "wb") as fh:
        chunk = b"\0" * (1 << 20)
        left = size
        with contextlib.suppress(OSError):  # a snapshot writing meanwhile may take the last bytes first
            while left > 0:
                left -= fh.write(chunk[: min(left, len(chunk))])
    from controller import events

    def attempted() -> Any:
        for e in events.read(ctx.store, ctx.job, limit=2000):
            if e.get("kind") in ("snapshot_failed", "snapshot") and e.get("time", 0) >= rec["injected_at"]:
                return e
        return ctx.record().phase in jobs.TERMINAL

    try:
        got = ctx.wait_for(attempted, f.wait_s, "snapshot attempt on the full disk")
        rec["note"] = f"next snapshot: {got.get('kind')}" if isinstance(got, dict) else "job ended"
    finally:
        with contextlib.suppress(FileNotFoundError):
            ballast.unlink()
        rec["ended_at"] = time.time()


INJECTORS: dict[str, Callable[[Ctx, Fault, dict[str, Any]], None]] = {
    "rollout_kill": rollout_kill,
    "rollout_hang": rollout_hang,
    "rollout_slow": rollout_slow,
    "rollout_preempt": rollout_preempt,
    "trainer_kill": trainer_kill,
    "trainer_preempt": trainer_preempt,
    "trainer_hang": trainer_hang,
    "journal_full": journal_full,
    "reward_hang": reward_hang,
    "leader_kill": leader_kill,
    "leader_pause": leader_pause,
    "etcd_restart": etcd_restart,
    "etcd_outage": etcd_outage,
    "etcd_member_kill": etcd_member_kill,
    "snapshot_corrupt": snapshot_corrupt,
    "disk_full": disk_full,
    "ray_node_remove": ray_node_remove,
    "scale": scale,
}


def inject(ctx: Ctx, f: Fault, rec: dict[str, Any]) -> None:
    """Run one fault's injector, recording the outcome in ``rec["status"]``."""
    rec["status"] = "injecting"
    try:
        INJECTORS[f.kind](ctx, f, rec)
        rec["status"] = "injected"
    except Skip as e:
        rec["status"], rec["note"] = "skipped", str(e)
    except Exception as e:  # an injector bug or a platform error: recorded, the run goes on
        log.exception("fault %s failed", f.kind)
        rec["status"], rec["note"] = "failed", f"{type(e).__name__}: {e}"
        if rec.get("injected_at") and not rec.get("ended_at"):
            rec["ended_at"] = time.time()
