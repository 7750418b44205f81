"""A controller process whose job driver kills the process it runs in (SIGKILL) for as long as
the flag file given exists: how a poison job takes a leader down. Everything else is the real
Controller on a real etcd. Used by tests/integration/test_controller_record.py.

    python -m tests.helpers.poison_controller ETCD CONTROLLER_ID FLAG_FILE
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

from controller.service import Controller
from controller.store import Store


class _Calm:
    def __init__(self, c: Controller, rec: Any) -> None:
        c.update_state(rec.id, phase="RUNNING")

    def reconcile(self, rec: Any) -> None:
        return None

    def stop(self, final: bool) -> None:
        pass


def main() -> None:
    etcd, cid, flag = sys.argv[1], sys.argv[2], Path(sys.argv[3])

    def factory(c: Controller, rec: Any) -> _Calm:
        if flag.exists():
            os.kill(os.getpid(), signal.SIGKILL)  # the poison: the leader dies starting this job
        return _Calm(c, rec)

    c = Controller(Store(etcd), cid, ttl=2, driver_factory=factory, interval=0.2)
    signal.signal(signal.SIGTERM, lambda *_: c.stop())
    c.run()


if __name__ == "__main__":
    main()
