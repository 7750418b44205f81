"""A leader-election candidate in its own process, for the election tests.

Campaigns, then once a leader, every 0.2 s attempts a fenced write *with the
token it won* (whatever it currently believes, so that a stale leader's write
really reaches etcd) and prints one JSON line per attempt:
``{"event": "write", "ok": bool, "is_leader": bool, "token": int}``.
"""

from __future__ import annotations

import json
import sys
import time

from controller.election import Election, NotLeader, fenced_txn
from controller.store import Put, Store


def say(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def main() -> None:
    endpoint, cid, ttl = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = Store(endpoint, timeout=1.0, retry_window=3.0)
    el = Election(store, cid, ttl=ttl)
    el.campaign(poll=0.2)
    token = el.token
    say(event="leader", id=cid, token=token)
    n = 0
    while True:
        n += 1
        try:
            fenced_txn(store, token, success=[Put(f"/rrl/v1/probe/{cid}", str(n))])
            ok = True
        except NotLeader:
            ok = False
        say(event="write", ok=ok, is_leader=el.is_leader, token=token, n=n, t=time.time())
        time.sleep(0.2)


if __name__ == "__main__":
    main()
