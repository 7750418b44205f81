"""`bench overhead --load N`: the background load's processes (their own sessions, ended by handle)."""

from __future__ import annotations

import os

from bench.overhead import background_load


def test_the_background_load_runs_each_busy_process_in_a_session_of_its_own_and_ends_them() -> None:
    with background_load(2) as procs:
        assert len(procs) == 2
        for p in procs:
            assert p.poll() is None  # running
            assert os.getsid(p.pid) == p.pid != os.getsid(0)  # a session leader, not in this session
    assert all(p.returncode is not None for p in procs)  # ended and reaped
    with background_load(0) as none:
        assert none == []
