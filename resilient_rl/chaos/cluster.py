"""The platform a chaos run starts for itself and may break: etcd members, Ray nodes,
controllers, all on 127.0.0.1 under the run's own ``$RRL_HOME``.

Built from :mod:`resilient_rl.local`'s helpers: etcd members are
:func:`start_etcd` children (kept so that they can be killed and restarted on the
same data dir and ports), the Ray head comes from :class:`Platform` (``up`` with
no controllers), extra Ray nodes and the controllers are
:class:`ManagedProcess` sessions. A killed controller is replaced by a fresh one
(as a supervisor would), so the standby count holds through a run.

Every process is stopped by PID / process group in :meth:`ChaosCluster.stop`;
:meth:`owns` tells whether a PID belongs to this platform (itself or a
descendant of one of its processes), and injectors refuse any other PID.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..local import ManagedProcess, Platform, free_ports, pid_alive, ray_env, start_etcd
from .scenario import ClusterShape


@dataclass
class EtcdMember:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log: Path
    initial_cluster: str
    proc: ManagedProcess | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> None:
        self.proc = start_etcd(
            self.data_dir, self.client_port, self.peer_port, self.log, name=self.name,
            initial_cluster=self.initial_cluster, wait=30.0,
        )  # fmt: skip

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None:
            self.proc.kill() if kill else self.proc.stop(timeout=10.0)
            self.proc = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.alive()


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _session(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[3])
    except (OSError, ValueError, IndexError):
        return 0


def start_time(pid: int) -> int:
    """The process's start time in clock ticks (tells a PID from its reuse)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


class ChaosCluster:
    """Start, break and stop one chaos run's platform (see module doc)."""

    def __init__(self, home: Path, shape: ClusterShape, log: Any = print) -> None:
        self.home = home
        self.shape = shape
        self.log = log
        self.platform = Platform(home)
        self.etcd: list[EtcdMember] = []
        self.controllers: dict[str, ManagedProcess] = {}
        self.ray_nodes: list[ManagedProcess] = []
        self.ray_address = ""
        self.tmpfs: Path | None = None
        self.journal_tmpfs: Path | None = None
        self._n_controllers = 0

    # -- start / stop ------------------------------------------------------------

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.etcd)

    def _mount(self, where: Path, mb: int, field: str) -> Path:
        where.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", str(where)], capture_output=True)
        if r.returncode != 0:
            raise RuntimeError(f"cluster.{field}: cannot mount a tmpfs on {where} (needs root): "
                               f"{r.stderr.decode().strip()}")  # fmt: skip
        return where

    def start(self, snapshot_dir: Path | None = None, journal_dir: Path | None = None) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        logs = self.home / "logs"
        names = [f"etcd{i}" for i in range(self.shape.etcd_members)]
        ports = [tuple(free_ports(2)) for _ in names]
        initial = ",".join(f"{n}=http://127.0.0.1:{p}" for n, (_, p) in zip(names, ports, strict=True))
        for n, (c, p) in zip(names, ports, strict=True):
            self.etcd.append(EtcdMember(n, c, p, self.home / "etcd" / n, logs / f"{n}.log", initial))
        for m in self.etcd:
            m.start()
        if self.shape.checkpoint_tmpfs_mb and snapshot_dir is not None:
            self.tmpfs = self._mount(snapshot_dir, self.shape.checkpoint_tmpfs_mb, "checkpoint_tmpfs_mb")
        if self.shape.journal_tmpfs_mb and journal_dir is not None:
            self.journal_tmpfs = self._mount(journal_dir, self.shape.journal_tmpfs_mb, "journal_tmpfs_mb")
        data = self.platform.up(etcd=self.endpoints, controllers=0, progress=lambda *_: None)
        self.ray_address = data["ray"]
        for i in range(1, self.shape.ray_nodes):
            argv = [str(Path(sys.executable).parent / "ray"), "start", "--address", self.ray_address, "--block",
                    "--node-ip-address", "127.0.0.1", "--num-cpus", "2", "--disable-usage-stats"]  # fmt: skip
            self.ray_nodes.append(ManagedProcess.spawn(f"ray-node{i}", argv, logs / f"ray-node{i}.log", env=ray_env()))
        for _ in range(self.shape.controllers):
            self.spawn_controller()

    def spawn_controller(self) -> str:
        """Start one more controller (a standby unless nobody leads); returns its id."""
        cid = f"chaos-c{self._n_controllers}"
        self._n_controllers += 1
        argv = [sys.executable, "-m", "resilient_rl.cli", "controller", "--etcd", self.endpoints,
                "--ray-address", self.ray_address, "--id", cid, "--ttl", str(self.shape.leader_ttl)]  # fmt: skip
        env = {**ray_env(), "RRL_HOME": str(self.home)}
        self.controllers[cid] = ManagedProcess.spawn(cid, argv, self.home / "logs" / f"{cid}.log", env=env)
        return cid

    def stop(self) -> None:
        """Stop everything this cluster started (by PID / process group), then unmount."""
        for p in [*self.controllers.values(), *self.ray_nodes]:
            with contextlib.suppress(Exception):
                p.stop(timeout=10.0)
        with contextlib.suppress(Exception):
            self.platform.down(progress=lambda *_: None)
        for m in self.etcd:
            with contextlib.suppress(Exception):
                m.stop()
        for mnt in (self.tmpfs, self.journal_tmpfs):
            if mnt is not None:
                subprocess.run(["umount", str(mnt)], capture_output=True)
        self.tmpfs = self.journal_tmpfs = None

    # -- ownership ---------------------------------------------------------------

    def roots(self) -> set[int]:
        """PIDs of the processes this cluster started directly (each leads its own session)."""
        pids = {p.pid for p in [*self.controllers.values(), *self.ray_nodes]}
        pids |= {m.proc.pid for m in self.etcd if m.proc is not None}
        pids |= {int(v["pid"]) for v in self.platform.load().get("processes", {}).values()}
        return pids

    def owns(self, pid: int) -> bool:
        """Whether ``pid`` is one of ours: in one of our sessions, or a descendant of ours."""
        if pid <= 1 or not pid_alive(pid):
            return False
        roots = self.roots()
        if _session(pid) in roots:
            return True
        p, seen = pid, 0
        while p > 1 and seen < 64:
            if p in roots:
                return True
            p, seen = _ppid(p), seen + 1
        return False

    def signal_pid(self, pid: int, sig: int, group: bool = False) -> bool:
        """Send ``sig`` to ``pid`` (or its process group) if it belongs to this platform, else
        raise ValueError. A process that is already gone is not an error: False says it was
        not there to signal (a worker can exit between being chosen and being hit)."""
        if not self.owns(pid):
            if not pid_alive(pid):
                return False
            raise ValueError(f"pid {pid} is not a process of this chaos platform: refusing to signal it")
        try:
            os.killpg(pid, sig) if group else os.kill(pid, sig)
        except ProcessLookupError:
            return False
        return True

    def controller_by_pid(self, pid: int) -> tuple[str, ManagedProcess] | None:
        return next(((c, p) for c, p in self.controllers.items() if p.pid == pid), None)

    def ray_node_of(self, pid: int) -> int | None:
        """Index (1-based, as in ``ray_nodes``) of the extra Ray node ``pid`` runs under."""
        for i, node in enumerate(self.ray_nodes, start=1):
            p, seen = pid, 0
            if _session(pid) == node.pid:
                return i
            while p > 1 and seen < 64:
                if p == node.pid:
                    return i
                p, seen = _ppid(p), seen + 1
        return None
