"""The embedded single-machine platform: a local etcd, a Ray head and a controller.

``rrl up`` starts each as a child process in its own session (process group),
bound to 127.0.0.1, with data and logs under ``$RRL_HOME`` (default ``~/.rrl``),
and records their PIDs and addresses in ``$RRL_HOME/platform.json``. ``rrl
down`` ends exactly those process groups, by PID, and nothing else: Ray's own
``ray stop`` kills by process name and would hit other users' Ray.

The same :class:`ManagedProcess` / :func:`start_etcd` helpers start the etcd
servers of the test suite and the chaos harness.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class PlatformError(RuntimeError):
    """The local platform could not be started or stopped; the message says why."""


class PlatformInputError(PlatformError):
    """A value given to the platform (a flag, or one kept in platform.json) that it cannot take;
    raised before anything is started. The CLI exits 2 on it."""


def rrl_home() -> Path:
    return Path(os.environ.get("RRL_HOME") or Path.home() / ".rrl").expanduser()


def token_path(home: Path | None = None) -> Path:
    """The API token file: ``$RRL_HOME/token`` (mode 0600)."""
    return (home or rrl_home()) / "token"


def ensure_token(path: Path) -> str:
    """Return the API token in ``path``, creating it (random, mode 0600) if it is missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return path.read_text().strip()


def read_token(home: Path | None = None) -> str | None:
    """The token the CLI sends: ``$RRL_TOKEN``, else ``$RRL_HOME/token``, else None."""
    if os.environ.get("RRL_TOKEN"):
        return os.environ["RRL_TOKEN"].strip()
    try:
        return token_path(home).read_text().strip() or None
    except OSError:
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: each socket is held until all are chosen (two free_port()
    calls in a row may return the same port, and an etcd given one port twice binds one
    listener and exits, while the port answers)."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child still answers kill(0); look at its state
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def session_pids(sid: int) -> list[int]:
    """PIDs of live processes whose session id is ``sid`` (Linux /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields after the command: state ppid pgrp session ...
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(d))
    return out


@dataclass
class ManagedProcess:
    """A child started in its own session; ``stop()`` ends the whole session by PID."""

    name: str
    pid: int
    popen: subprocess.Popen[bytes] | None = None

    @classmethod
    def spawn(cls, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> ManagedProcess:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            p = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )
        return cls(name, p.pid, p)

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return pid_alive(self.pid)

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the process group, wait, then SIGKILL whatever of the session is left."""
        self.signal(signal.SIGCONT)  # a stopped process cannot handle SIGTERM
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen is not None:
                self.popen.poll()
            if not session_pids(self.pid):
                break
            time.sleep(0.1)
        for pid in session_pids(self.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=5)

    def kill(self) -> None:
        """SIGKILL the process group at once (a crash)."""
        self.signal(signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait(timeout=10)


def etcd_binary() -> str:
    path = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if path is None:
        raise PlatformError(
            "the etcd server binary was not found on PATH. Install it with "
            "`sudo apt-get install etcd-server` (Debian/Ubuntu), or point rrl at an existing "
            "cluster with --etcd host:port / RRL_ETCD."
        )
    return path


def start_etcd(
    data_dir: Path,
    client_port: int,
    peer_port: int,
    log_path: Path,
    *,
    name: str = "rrl",
    initial_cluster: str | None = None,
    extra: list[str] | None = None,
    wait: float = 20.0,
) -> ManagedProcess:
    """Start an etcd member on 127.0.0.1 and wait until its client port answers."""
    data_dir.mkdir(parents=True, exist_ok=True)
    client = f"http://127.0.0.1:{client_port}"
    peer = f"http://127.0.0.1:{peer_port}"
    argv = [
        etcd_binary(),
        "--name", name,
        "--data-dir", str(data_dir),
        "--listen-client-urls", client,
        "--advertise-client-urls", client,
        "--listen-peer-urls", peer,
        "--initial-advertise-peer-urls", peer,
        "--initial-cluster", initial_cluster or f"{name}={peer}",
        "--initial-cluster-state", "new",
        "--heartbeat-interval", "100",
        "--election-timeout", "1000",
        *(extra or []),
    ]  # fmt: skip
    proc = _start_and_await(lambda: ManagedProcess.spawn(f"etcd:{name}", argv, log_path), client_port, "etcd",
                            log_path, wait, poll=0.05)  # fmt: skip
    if not proc.alive():  # the port answered, but not for this process (it was taken)
        raise PlatformError(f"etcd exited at start; see {log_path}:\n{_tail(log_path)}")
    return proc


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM (in the main thread) for the body: they are collected instead of
    handled. For a spawn, which a signal must not interrupt between the child's start and the
    parent's handle on it. As the body ends the handlers are restored and the held signals
    handled by them: a handler that raises does so at the ``with`` statement, after the body
    recorded what it spawned; if the body raised (the spawn failed: nothing to stop), that
    handler's error replaces the body's."""
    held: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old: dict[int, Any] = {}

    def restore() -> None:
        for s, h in old.items():  # None: a handler installed from C, which Python cannot put back
            signal.signal(s, signal.SIG_DFL if h is None else h)

    try:
        for s in (signal.SIGINT, signal.SIGTERM):  # one at a time: a signal between two is restored
            old[s] = signal.signal(s, lambda signum, frame: held.append(signum))
        yield
    finally:
        restore()
        for s in held:
            signal.raise_signal(s)  # a handler that raises replaces the spawn's error: the stop was asked


def _start_and_await(
    spawn: Callable[[], ManagedProcess], port: int, what: str, log_path: Path, wait: float, poll: float
) -> ManagedProcess:
    """Start a process (``spawn``) and wait until it opens 127.0.0.1:``port``. It is stopped if
    it does not within ``wait`` seconds (PlatformError), and if Ctrl-C or SIGTERM
    (``resilient_rl.signals``) interrupts the wait, which then goes on interrupting: else it would
    run on with no record that ``rrl down`` could stop it by. A signal that comes while the
    process is being spawned is held and handled once its handle is here (one that came inside
    ``subprocess.Popen`` left a Ray head running, unrecorded: CI, 2026-12-07). PlatformError with
    the log's tail if it exits first."""
    proc: ManagedProcess | None = None
    try:
        with _signals_held():  # a held signal's handler raises at its end, and proc is stopped
            proc = spawn()
        deadline = time.monotonic() + wait
        while not port_open("127.0.0.1", port):
            if not proc.alive():
                raise PlatformError(f"{what} exited at start; see {log_path}:\n{_tail(log_path)}")
            if time.monotonic() > deadline:
                proc.stop()
                raise PlatformError(f"{what} did not open 127.0.0.1:{port} within {wait:.0f}s; see {log_path}")
            time.sleep(poll)
    except (KeyboardInterrupt, SystemExit):
        if proc is not None:
            proc.stop(timeout=5.0)
        raise
    return proc


def check_object_store(gib: Any, shm: str | None = "/dev/shm", name: str = "--object-store-gib") -> None:
    """PlatformInputError, naming ``name`` (the flag, or where the value was read), for a size Ray's
    store cannot take here: not a finite number, under Ray's minimum (75 MiB; 0.1 GiB here), or
    more than the shared memory (``shm``; None: not asked) can hold, where Ray would fall back to
    a store on disk; the whole size is written at start. None and 0: Ray's default."""
    if gib is None or (isinstance(gib, (int, float)) and not isinstance(gib, bool) and gib == 0):
        return
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not math.isfinite(gib):
        raise PlatformInputError(f"{name} {gib!r}: not a size in GiB")
    if gib < 0.1:
        raise PlatformInputError(f"{name} {gib:g}: Ray's object store needs at least 0.1 GiB")
    if shm is None:
        return
    try:
        room = shutil.disk_usage(shm).free / 2**30
    except OSError:
        return  # no /dev/shm (not Linux): Ray judges
    if gib > room:
        raise PlatformInputError(f"{name} {gib:g}: more than the {room:.1f} GiB free in {shm}, "
                                 "which holds the whole store once it is preallocated")  # fmt: skip


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# --- the embedded platform (rrl up / rrl down) --------------------------------


def ray_env() -> dict[str, str]:
    """Environment that keeps every Ray listener on 127.0.0.1 (see docs/architecture.md)."""
    return {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
    }


def ray_head_env() -> dict[str, str]:
    """`ray_env` for a process that starts a Ray head.

    Ray waits 30 s for a new GCS to publish its port. On a loaded 2-core machine the GCS took
    longer (CI of stop 25: "Timed out waiting for file .../gcs_server_port"), and a head that is
    slow to start is not a failure: wait as long as Ray itself does for a RocksDB-backed GCS.
    Only heads get this: in a driver the same variable also stretches the connect retries, and a
    driver facing a dead head should learn it in Ray's usual ~20 s.
    """
    return {**ray_env(), "RAY_gcs_server_port_wait_time_s": "120"}


class Platform:
    """The processes of the embedded platform, persisted in ``$RRL_HOME/platform.json``."""

    def __init__(self, home: Path | None = None) -> None:
        self.home = home or rrl_home()
        self.file = self.home / "platform.json"

    def check_home(self) -> None:
        """PlatformInputError when ``$RRL_HOME`` cannot be the platform's folder (it, or a folder
        above it, is a file); raised before anything is started or stopped."""
        for p in (self.home, *self.home.parents):
            if p.exists():
                if not p.is_dir():
                    raise PlatformInputError(f"RRL_HOME {self.home}: {p} is not a folder")
                return

    def load(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self.file.read_text()))
        except (OSError, ValueError):
            return {}

    def save(self, data: dict[str, Any]) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        os.replace(tmp, self.file)

    def running(self) -> dict[str, Any]:
        """The recorded processes that are still alive: ``{name: record}``."""
        return {k: v for k, v in self.load().get("processes", {}).items() if pid_alive(v["pid"])}

    def etcd_endpoint(self) -> str | None:
        d = self.load()
        return d.get("etcd") if d.get("processes", {}).get("etcd") else None

    def up(
        self,
        *,
        etcd: str | None = None,
        ray_address: str | None = None,
        controllers: int = 1,
        progress: Any = print,
        allow_kill: bool | None = None,
        object_store_gib: float | None = None,
    ) -> dict[str, Any]:
        """Start whatever is not running yet; idempotent. Returns the platform record.
        ``allow_kill``: controllers serve the chaos kill route (``--allow-kill``); None keeps
        what the platform was brought up with (a controller restarted later keeps its flags).
        ``object_store_gib``: the Ray head's object store, that size and preallocated (see
        :meth:`_start_ray`); None keeps what the platform was brought up with (0: Ray's own)."""
        self.check_home()
        data = self.load()
        if allow_kill is not None:
            data["allow_kill"] = allow_kill
        allow_kill = bool(data.get("allow_kill", False))
        procs: dict[str, Any] = self.running()
        if object_store_gib is not None:
            check_object_store(object_store_gib, shm=None)  # a value that is no size is not kept
            if object_store_gib and ray_address:
                progress("--object-store-gib: no Ray head is started here (--ray-address); size that cluster's "
                         "store where it starts (`ray start --object-store-memory`, RAY_preallocate_plasma_memory=1)")  # fmt: skip
            elif object_store_gib and "ray" in procs and data.get("object_store_gib") != object_store_gib:
                progress("--object-store-gib: the Ray head runs already with its object store; the new size "
                         "applies when it next starts (`rrl down`, then `rrl up`)")  # fmt: skip
            data["object_store_gib"] = object_store_gib or None
        if not ray_address and "ray" not in procs:  # a Ray head is started below, with this store
            check_object_store(data.get("object_store_gib"), name="--object-store-gib" if object_store_gib else
                               f"object_store_gib in {self.file} (an earlier `rrl up --object-store-gib`)")  # fmt: skip
        ports = data.get("ports") or {}
        logs = self.home / "logs"

        if etcd:
            data["etcd"] = etcd
            procs.pop("etcd", None)
        elif "etcd" not in procs:
            client, peer = free_ports(2)
            ports.setdefault("etcd_client", client)
            ports.setdefault("etcd_peer", peer)
            progress(f"starting etcd on 127.0.0.1:{ports['etcd_client']} (data {self.home / 'etcd'})")
            p = start_etcd(self.home / "etcd", ports["etcd_client"], ports["etcd_peer"], logs / "etcd.log")
            procs["etcd"] = {"pid": p.pid, "log": str(logs / "etcd.log")}
            data["etcd"] = f"127.0.0.1:{ports['etcd_client']}"
            # recorded at once: interrupted later (Ctrl-C, SIGTERM), `rrl down` still stops it, and
            # the next `rrl up` takes it over instead of starting a second etcd on its data dir
            self.save({**data, "ports": ports, "processes": procs})

        if ray_address:
            data["ray"] = ray_address
            procs.pop("ray", None)
        elif "ray" not in procs:
            ports["ray"] = free_port() if not ports.get("ray") or port_open("127.0.0.1", ports["ray"]) else ports["ray"]
            progress(f"starting Ray head on 127.0.0.1:{ports['ray']}")
            p = self._start_ray(ports["ray"], logs / "ray.log", object_store_gib=data.get("object_store_gib"))
            procs["ray"] = {"pid": p.pid, "log": str(logs / "ray.log")}
            data["ray"] = f"127.0.0.1:{ports['ray']}"

        data["ports"] = ports
        data["processes"] = procs
        self.save(data)

        ensure_token(token_path(self.home))  # before any controller: they all serve with it
        api = dict(data.get("api") or {})
        for i in range(controllers):
            name = f"controller-{i}"
            if name in procs:
                continue
            # the same HTTP port as last time if it is free, so a bookmarked page keeps working
            port = ports.get(f"http_{i}")
            if not port or port_open("127.0.0.1", port):
                port = ports[f"http_{i}"] = free_port()
            progress(f"starting controller {name} (http://127.0.0.1:{port}/)")
            argv = [
                sys.executable, "-m", "resilient_rl.cli", "controller",
                "--etcd", data["etcd"], "--ray-address", data["ray"],
                "--id", f"{socket.gethostname()}-{i}",
                "--http-port", str(port), "--token-file", str(token_path(self.home)),
                *(["--allow-kill"] if allow_kill else []),
            ]  # fmt: skip
            # a signal while it is spawned is handled once it is recorded, so `rrl down` stops it
            with _signals_held():
                p = ManagedProcess.spawn(
                    name, argv, logs / f"{name}.log", env={**ray_env(), "RRL_HOME": str(self.home)}
                )
                try:
                    procs[name] = {"pid": p.pid, "log": str(logs / f"{name}.log")}
                    api[name] = f"http://127.0.0.1:{port}"
                    data["api"] = api
                    self.save(data)
                except BaseException:  # not recorded (a full disk): not left running either
                    p.stop(timeout=5.0)
                    raise
        return data

    def ray_temp_dir(self) -> Path:
        """Ray's session folder. Ray puts AF_UNIX sockets in it (107-byte path limit), so a
        deep $RRL_HOME gets a short folder under /tmp named after it instead."""
        path = self.home / "ray"
        if len(str(path)) <= 40:
            return path
        digest = hashlib.sha1(str(self.home.resolve()).encode()).hexdigest()[:10]
        return Path(tempfile.gettempdir()) / f"rrl-ray-{digest}"

    def _start_ray(
        self, port: int, log_path: Path, wait: float = 90.0, object_store_gib: float | None = None
    ) -> ManagedProcess:
        """Start the Ray head. ``object_store_gib``: its object store's size, every page written
        once at start (Ray's ``preallocate_plasma_memory``): a published weight version then
        lands in memory touched before, a copy at the memcpy floor, instead of paying a page
        fault a page (BENCHMARKS.md section 4: 100M parameters to 4 workers 2.5x the floor,
        against 7.6x with Ray's default store). None: Ray's default size (30 % of memory), not
        preallocated."""
        ray_bin = Path(sys.executable).parent / "ray"
        if not ray_bin.exists():
            ray_bin = Path(shutil.which("ray") or "ray")
        argv = [
            str(ray_bin), "start", "--head", "--block",
            "--port", str(port), "--node-ip-address", "127.0.0.1",
            "--include-dashboard", "false", "--disable-usage-stats",
            # logical CPUs for scheduling: small jobs oversubscribe a laptop-sized machine
            "--num-cpus", str(max(os.cpu_count() or 1, 8)),
            "--temp-dir", str(self.ray_temp_dir()),
        ]  # fmt: skip
        env = ray_head_env()
        if object_store_gib:
            argv += ["--object-store-memory", str(int(object_store_gib * 2**30))]
            env["RAY_preallocate_plasma_memory"] = "1"
        return _start_and_await(lambda: ManagedProcess.spawn("ray", argv, log_path, env=env), port, "Ray head",
                                log_path, wait, poll=0.2)  # fmt: skip

    def down(self, progress: Any = print) -> list[str]:
        """Stop every process ``up`` started (controllers first, etcd last). Returns their names."""
        self.check_home()
        data = self.load()
        procs = data.get("processes", {})
        order = sorted(procs, key=lambda n: (n == "etcd", n == "ray", n))
        stopped = []
        for name in order:
            rec = procs[name]
            if pid_alive(rec["pid"]) or session_pids(rec["pid"]):
                progress(f"stopping {name} (pid {rec['pid']})")
                # Ray's `start --block` can take long to pass SIGTERM on to a raylet that is
                # still starting; its state is disposable, so it gets a short grace period.
                ManagedProcess(name, rec["pid"]).stop(timeout=5.0 if name == "ray" else 15.0)
                stopped.append(name)
        data["processes"] = {}
        if data:
            self.save(data)
        return stopped
