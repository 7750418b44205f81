"""Shared fixtures. Real components, no fakes: a real etcd server per test
(fresh data dir, free loopback ports, stopped by PID), real subprocesses.

A missing etcd binary fails the run (it never skips): `make test` installs it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controller.store import Store
from resilient_rl.local import ManagedProcess, free_ports, start_etcd

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
REPO = Path(__file__).resolve().parent.parent


def pytest_report_header(config: pytest.Config) -> list[str]:
    """What a slow or failing run on a shared machine is read against: the free disk where the
    tests write (a CI run once died of ENOSPC, its disk shared with other machines) and the load."""
    import tempfile

    where = {"temporary folders": Path(tempfile.gettempdir()), "the checkout": REPO}
    free = ", ".join(f"{shutil.disk_usage(p).free / 1e9:.1f} GB for {k} ({p})" for k, p in where.items())
    return [f"free disk: {free}", f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"]


# `make test PYTEST_ARGS="-n 2"` spreads the run over two pytest-xdist workers (the default,
# `-n 0` in pyproject's addopts, runs it serially). The end-to-end tests then run in two serial
# groups, each on one worker: those on the shared platform (tests/e2e/conftest.py; one per
# worker process, so one in all) and those of the modules below, which start their own (chaos
# runs, a Ray cluster, a platform stopped and started again, a bare vLLM engine). Each other
# test is a unit of its own: the unit and integration tests mostly wait (on leases, timeouts,
# subprocesses), so they run beside an end-to-end job, and at most two end-to-end jobs run at
# once. Not the default yet: under that load (load average 10-15 on 2 cores) some unit and
# integration tests that wait on short timeouts failed (README, Development).
E2E_OWN_PLATFORM = frozenset({"test_chaos.py", "test_node_loss.py", "test_resume.py", "test_model_vllm.py"})


def xdist_scope(nodeid: str) -> str:
    """The unit of work a test is sent to a worker in (see above)."""
    path = nodeid.split("::", 1)[0]
    if path.startswith("tests/e2e/"):
        return "e2e-own" if path.rsplit("/", 1)[-1] in E2E_OWN_PLATFORM else "e2e-platform"
    return nodeid


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduler over :func:`xdist_scope`. (Its ``--dist loadgroup`` cannot be used:
    xdist 3.8 marks a group in ``item._nodeid``, which pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class E2EGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return E2EGroups(config, log)


def pytest_itemcollected(item: pytest.Item) -> None:
    """A test of a module in E2E_OWN_PLATFORM must not ask for the shared platform: it would
    start a second one on the other worker."""
    if xdist_scope(item.nodeid) == "e2e-own" and "platform" in getattr(item, "fixturenames", ()):
        raise pytest.UsageError(f"{item.nodeid} uses the shared platform: take its module out of E2E_OWN_PLATFORM")


@pytest.fixture(scope="session", autouse=True)
def _rrl_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No test reaches the user's ~/.rrl: RRL_HOME is a folder of this run's unless a test
    or fixture sets its own (the shared platform's, a test's tmp_path)."""
    old = os.environ.get("RRL_HOME")
    os.environ["RRL_HOME"] = str(tmp_path_factory.mktemp("rrl-home-default"))
    yield
    if old is None:
        os.environ.pop("RRL_HOME", None)
    else:
        os.environ["RRL_HOME"] = old


def pytest_sessionstart(session: pytest.Session) -> None:
    if shutil.which("etcd") is None and not os.path.exists("/usr/bin/etcd"):
        raise pytest.UsageError(
            "etcd is not installed: run `make test` (it installs etcd-server) instead of bare pytest"
        )


class EtcdServer:
    """One real etcd member on loopback that a test can stop, kill and restart (same data)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.client_port, self.peer_port = free_ports(2)
        self.proc: ManagedProcess | None = None
        self.stores: list[Store] = []
        self.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> None:
        self.proc = start_etcd(self.root / "data", self.client_port, self.peer_port, self.root / "etcd.log")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def store(self, **kw: object) -> Store:
        s = Store(self.endpoint, **kw)  # type: ignore[arg-type]
        self.stores.append(s)
        return s

    def close(self) -> None:
        for s in self.stores:
            s.close()
        self.stop()


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path / "etcd")
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def store(etcd: EtcdServer) -> Store:
    return etcd.store()


@pytest.fixture
def rrl_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "rrl-home"
    monkeypatch.setenv("RRL_HOME", str(home))
    monkeypatch.delenv("RRL_ETCD", raising=False)
    return home


def proc_state(pid: int) -> str:
    """The process's state letter and its threads' (``T`` is stopped), from /proc."""

    def letter(stat: str) -> str:
        return open(stat).read().rsplit(")", 1)[1].split()[0]

    threads = {letter(f"/proc/{pid}/task/{t}/stat") for t in os.listdir(f"/proc/{pid}/task")}
    return f"state {letter(f'/proc/{pid}/stat')}, threads {''.join(sorted(threads))}"


def until_stopped(pid: int) -> None:
    """SIGSTOP is a group stop: wait until every thread of the process has stopped."""
    deadline = time.monotonic() + 5
    while proc_state(pid) != "state T, threads T":
        assert time.monotonic() < deadline, f"pid {pid} did not stop: {proc_state(pid)}"
        time.sleep(0.01)


def run_rrl(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the real `rrl` console script (as a user would)."""
    rrl = Path(sys.executable).parent / "rrl"
    return subprocess.run(
        [str(rrl), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )


@pytest.fixture
def small_disk(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A real small filesystem (tmpfs; the test process runs as root): ``size`` from
    ``@pytest.mark.parametrize("small_disk", ["256k"], indirect=True)``, default 48m."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    size = getattr(request, "param", "48m")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)
