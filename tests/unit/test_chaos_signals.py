"""The chaos harness signals only its own processes, and a worker that exits between being
chosen and being hit is not a failed fault: another is chosen (a race seen in CI)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from resilient_rl.chaos import faults
from resilient_rl.chaos.cluster import ChaosCluster
from resilient_rl.chaos.scenario import ClusterShape, Fault


class _Cluster(ChaosCluster):
    def __init__(self, home: Path, roots: set[int]) -> None:
        super().__init__(home, ClusterShape())
        self._roots = roots

    def roots(self) -> set[int]:
        return self._roots


def _child() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)


def test_signal_pid_refuses_a_process_not_ours_and_reports_one_that_is_gone(tmp_path: Path) -> None:
    mine, other = _child(), _child()
    try:
        c = _Cluster(tmp_path, {mine.pid})
        with pytest.raises(ValueError, match=f"pid {other.pid} is not a process of this chaos platform"):
            c.signal_pid(other.pid, signal.SIGKILL)
        assert other.poll() is None
        assert c.signal_pid(mine.pid, signal.SIGKILL) is True
        mine.wait(10)
        assert c.signal_pid(mine.pid, signal.SIGKILL) is False  # gone: no error, nothing sent
    finally:
        for p in (mine, other):
            p.kill()
            p.wait(10)


def test_a_worker_that_exits_before_the_hit_is_replaced_by_another(tmp_path: Path) -> None:
    first, second = _child(), _child()
    try:
        c = _Cluster(tmp_path, {first.pid, second.pid})
        chosen = iter([("0", {"pid": first.pid}), ("1", {"pid": second.pid})])

        class _Ctx:
            cluster = c
            stop = threading.Event()

            def member(self, *a: Any, **k: Any) -> Any:
                return lambda: next(chosen)

            def wait_for(self, fn: Any, timeout: float, what: str) -> Any:
                got = fn()
                if got[0] == "0":  # the driver replaces it just after it was chosen
                    first.kill()
                    first.wait(10)
                return got

        f = Fault(kind="rollout_kill", at={"step": 1})
        rec: dict[str, Any] = {}
        faults.rollout_kill(_Ctx(), f, rec)  # type: ignore[arg-type]
        assert rec["target"]["pid"] == second.pid and rec["injected_at"]
        assert second.wait(10) == -signal.SIGKILL
    finally:
        for p in (first, second):
            p.kill()
            p.wait(10)
