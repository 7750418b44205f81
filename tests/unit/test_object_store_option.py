"""`rrl up --object-store-gib`: the Ray head's object store, that size and preallocated
(BENCHMARKS.md section 4: weight versions land in touched memory). The sizes Ray cannot take
are refused with exit 2 naming the flag, before anything starts; the head's command line and
environment carry the size and Ray's ``preallocate_plasma_memory``. That the store is then
really written at start was seen by hand (1 GiB in /dev/shm once the head was up)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from resilient_rl import local
from resilient_rl.local import Platform, PlatformError, check_object_store


def test_sizes_ray_cannot_take_are_refused_naming_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    check_object_store(None)
    check_object_store(0)  # Ray's default
    with pytest.raises(PlatformError, match=r"--object-store-gib 0.05: .*at least 0.1 GiB"):
        check_object_store(0.05)
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(local.shutil, "disk_usage", lambda path: usage._replace(free=3 * 2**30))
    check_object_store(2.5)
    with pytest.raises(PlatformError, match=r"--object-store-gib 4: more than the 3.0 GiB free in /dev/shm"):
        check_object_store(4)


@pytest.mark.parametrize("gib", ["0.05", "-1", "nan"])
def test_rrl_up_with_a_bad_size_exits_2_and_starts_nothing(tmp_path: Path, gib: str) -> None:
    rrl = Path(sys.executable).parent / "rrl"
    p = subprocess.run([str(rrl), "up", "--object-store-gib", gib], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "RRL_HOME": str(tmp_path)})  # fmt: skip
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "object-store-gib" in p.stderr and "Traceback" not in p.stderr + p.stdout, p.stderr
    assert not (tmp_path / "platform.json").exists() and not (tmp_path / "logs").exists()


def test_the_ray_head_gets_the_size_and_preallocation_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spawned: list[tuple[list[str], dict[str, str]]] = []

    def spawn(name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> Any:
        spawned.append((argv, dict(env or {})))
        return local.ManagedProcess(name, 0)

    monkeypatch.setattr(local.ManagedProcess, "spawn", staticmethod(spawn))
    monkeypatch.setattr(local, "port_open", lambda *a, **k: True)
    platform = Platform(tmp_path)
    platform._start_ray(1234, tmp_path / "ray.log", object_store_gib=1.5)
    platform._start_ray(1234, tmp_path / "ray.log")
    (asked, asked_env), (plain, plain_env) = spawned
    i = asked.index("--object-store-memory")
    assert asked[i + 1] == str(int(1.5 * 2**30)) and asked_env["RAY_preallocate_plasma_memory"] == "1"
    assert "--object-store-memory" not in plain and "RAY_preallocate_plasma_memory" not in plain_env


def test_a_sigterm_while_the_ray_head_is_spawned_stops_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The signal comes inside the spawn (as it did once in CI, inside ``subprocess.Popen``, and
    left a Ray head running that nothing recorded): it is held until the process's handle is
    here, then handled, and the process is stopped."""
    import signal

    stopped: list[int] = []

    class Started(local.ManagedProcess):
        def stop(self, timeout: float = 15.0) -> None:
            stopped.append(self.pid)

    def spawn(name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the child is being started
        return Started(name, 4242)

    def on_sigterm(signum: int, frame: Any) -> None:
        raise SystemExit(143)  # as resilient_rl.signals.exit_on_sigterm does

    monkeypatch.setattr(local.ManagedProcess, "spawn", staticmethod(spawn))
    monkeypatch.setattr(local, "port_open", lambda *a, **k: False)
    old = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        with pytest.raises(SystemExit):
            Platform(tmp_path)._start_ray(1234, tmp_path / "ray.log")
        assert signal.getsignal(signal.SIGTERM) is on_sigterm  # the handler is back
    finally:
        signal.signal(signal.SIGTERM, old)
    assert stopped == [4242]


def test_a_sigterm_while_a_controller_is_spawned_leaves_it_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same window for a controller: the signal is handled once the controller is in
    platform.json, where `rrl down` finds it."""
    import signal

    def spawn(name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)
        return local.ManagedProcess(name, 4343)

    def on_sigterm(signum: int, frame: Any) -> None:
        raise SystemExit(143)

    monkeypatch.setattr(local.ManagedProcess, "spawn", staticmethod(spawn))
    platform = Platform(tmp_path)
    old = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        with pytest.raises(SystemExit):
            platform.up(etcd="127.0.0.1:1", ray_address="127.0.0.1:2", progress=lambda *_: None)
        assert signal.getsignal(signal.SIGTERM) is on_sigterm
    finally:
        signal.signal(signal.SIGTERM, old)
    assert platform.load()["processes"]["controller-0"]["pid"] == 4343


def test_a_sigterm_during_a_spawn_that_fails_is_not_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import signal

    def spawn(name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)
        raise OSError("no such binary")

    def on_sigterm(signum: int, frame: Any) -> None:
        raise SystemExit(143)

    monkeypatch.setattr(local.ManagedProcess, "spawn", staticmethod(spawn))
    old = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        with pytest.raises(SystemExit):  # the stop that was asked, not the OSError
            Platform(tmp_path)._start_ray(1234, tmp_path / "ray.log")
        assert signal.getsignal(signal.SIGTERM) is on_sigterm
    finally:
        signal.signal(signal.SIGTERM, old)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1, "4", True])
def test_a_value_that_is_no_size_is_refused_wherever_it_comes_from(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(PlatformError, match="--object-store-gib"):
        check_object_store(bad, shm=None)
    # written into platform.json by hand: named there, refused before anything starts
    Platform(tmp_path).save({"object_store_gib": bad})
    with pytest.raises(PlatformError, match=r"object_store_gib in .*platform\.json"):
        Platform(tmp_path).up(progress=lambda *_: None)
    assert "processes" not in Platform(tmp_path).load()


@pytest.mark.parametrize("command", ["up", "run"])
def test_a_bad_size_kept_in_platform_json_exits_2_from_the_cli(tmp_path: Path, command: str) -> None:
    """`rrl up` and `rrl run` take the kept size when no flag is given: exit 2 naming the file,
    as for a bad flag (PlatformInputError), not 1 as for a platform that failed to start."""
    Platform(tmp_path).save({"object_store_gib": "lots"})
    job = Path(__file__).parents[2] / "examples" / "copy-tiny.yaml"
    args = ["up"] if command == "up" else ["run", str(job)]
    p = subprocess.run([str(Path(sys.executable).parent / "rrl"), *args], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "RRL_HOME": str(tmp_path)})  # fmt: skip
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "platform.json" in p.stderr and "Traceback" not in p.stderr + p.stdout, p.stderr
    assert "processes" not in Platform(tmp_path).load() and not (tmp_path / "logs").exists()


def test_the_room_in_shm_is_asked_only_where_a_ray_head_is_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store of 5 GiB written at start leaves /dev/shm 5 GiB fuller: the `rrl up` that only
    restarts a controller must not then refuse the size it started Ray with."""
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(local.shutil, "disk_usage", lambda path: usage._replace(free=3 * 2**30))
    started: list[str] = []
    monkeypatch.setattr(local.ManagedProcess, "spawn",
                        staticmethod(lambda name, *a, **k: started.append(name) or local.ManagedProcess(name, 1)))  # fmt: skip
    monkeypatch.setattr(local, "pid_alive", lambda pid: True)  # the recorded Ray head is up
    platform = Platform(tmp_path)
    platform.save({"object_store_gib": 5, "etcd": "127.0.0.1:1", "ray": "127.0.0.1:2",
                   "processes": {"etcd": {"pid": 1}, "ray": {"pid": 2}}})  # fmt: skip
    platform.up(progress=lambda *_: None)
    assert started == ["controller-0"]
    with pytest.raises(PlatformError, match="more than the 3.0 GiB free"):  # where it would start one
        Platform(tmp_path / "fresh").up(etcd="127.0.0.1:1", object_store_gib=5, progress=lambda *_: None)
