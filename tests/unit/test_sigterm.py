"""SIGTERM ends a command as Ctrl-C does (resilient_rl.signals): its ``finally`` runs, it exits
143, and a second SIGTERM during the clean-up does not cut it short. Real processes: a child
that starts a grandchild in a session of its own (as the chaos platform's processes are) and
stops it in ``finally``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

_CHILD = r"""
import subprocess, sys, time
from resilient_rl.signals import exit_on_sigterm
exit_on_sigterm()
g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
open(sys.argv[1], "w").write(str(g.pid))
try:
    time.sleep(120)
finally:
    print("cleaning up", flush=True)
    time.sleep(1.0)  # long enough for the test's second SIGTERM to arrive meanwhile
    g.terminate()
    g.wait(10)
    print("stopped", g.pid, flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


def test_sigterm_runs_the_clean_up_and_exits_143_and_a_second_one_is_ignored(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    p = subprocess.Popen([sys.executable, "-c", _CHILD, str(pidfile)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        grandchild = int(pidfile.read_text())
        assert _alive(grandchild)
        p.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # inside the clean-up's sleep now
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode == 143, (out, err)
    assert out.splitlines() == ["cleaning up", f"stopped {grandchild}"], (out, err)
    assert "terminated (SIGTERM): cleaning up" in err
    assert "Traceback" not in err
    assert not _alive(grandchild)
