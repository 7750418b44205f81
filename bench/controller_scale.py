"""Controller scale: N simulated workers against one local etcd and the real controller code.

``python -m bench scale [--sizes 500 1000 2000 5000] [--repeats 3] [--profile]``

What runs, per measured run (a fresh etcd, controller and simulators each time):

* **etcd**: a local single member (``resilient_rl.local.start_etcd``, data dir in a temp dir,
  127.0.0.1 only), the same flags ``rrl up`` uses.
* **the controller process** (product code, unmodified): ``controller.service.Controller.run()``
  (registration, election, and the leader's reconcile loop: every 0.5 s
  ``jobs.list_all(detail=False)``, one key read per job plus a txn of its spec/desired/state:
  since 2f37a03 it no longer reads every member, which it did before) with a
  driver whose ``reconcile`` returns None, which is what ``resilient_rl.job.runner``'s driver does
  per pass (it only copies ``rec.desired``; its Ray loop is not run here), and whose thread calls
  ``Controller.members`` for the workers' group and the trainer group once a second, as the
  runner's watchdogs do (a range read of the group each time: a watch per job served them
  for a day and cost more, BENCHMARKS.md section 6). The HTTP API / status page /
  ``/metrics`` are not served (they read members only when a client asks).
* **the probe**, a process of its own since 2026-12-03 (it ran inside the controller's before,
  and its watch, which the product's controller does not run, was up to half of the
  "controller" figure): a ``controller.membership.MembershipView`` on ``jobs/{job}/members/``
  whose ``on_leave`` records the wall time each leave is seen. Its CPU is reported apart.
* **the simulated workers**: ``--sim-procs`` processes (default 2) of asyncio gRPC clients, each
  holding N/k workers on ONE channel. Each worker has its own lease (TTL ``--ttl``, default 5 s as
  ``Registration(ttl=5)`` and ``fault.lease_ttl``), a member key ``keys.member(job, "rollout", i)``
  with the fields a rollout worker writes (node, pid, status, version, engine, ray_node,
  progress_at, step, shard, shards_done), a keep-alive every TTL/3 s (``KeptLease``'s cadence),
  all of a process's keep-alives multiplexed on one ``LeaseKeepAlive`` stream, and a progress
  put every ``--progress-every`` s (default 5 s: a rollout worker writes ``busy`` at the start and
  ``idle`` at the end of every shard, so one put per 5 s is a 10 s shard). Phases are staggered
  uniformly. The product's ``Store`` multiplexes its leases' keep-alives on one stream as well
  (it opened a stream per refresh until 2026-12-03).
* **the kill**: 1 % of the workers (random, seeded) stop keep-aliving and writing at once; each
  simulator records the wall time it stopped them. Detection latency = the wall time the
  controller's ``on_leave`` fired - that kill time (lower bound TTL - TTL/3, upper bound TTL plus
  etcd's 0.5 s expiry scan), p50/p99 over the killed workers.

Windows: after every worker is registered and seen by the controller, ``--warmup`` s, then a
steady window of ``--window`` s (no kills), then the kill window (from the kill until the last
killed worker's leave is seen). CPU seconds per second come from ``/proc/<pid>/stat``
(utime+stime, all threads) over each window; etcd's requests from its Prometheus ``/metrics``
(``grpc_server_msg_received_total``: one per unary call, one per streamed request such as a
keep-alive), puts from ``etcd_debugging_mvcc_put_total``. Every figure is the median (min-max) over
``--repeats`` runs. ``--profile`` records the controller with py-spy (an extra window after the
last kill window at the largest size, not counted in the figures). Writes
``bench/results/scale.json`` and ``bench/results/scale.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import json
import os
import queue
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import IO, Any

from bench import common
from controller.nodeagent import BATCH_S as AGENT_BATCH_S

JOB = "scale-bench"
GROUP = "rollout"
CLK_TCK = os.sysconf("SC_CLK_TCK")

# --- /proc and etcd metrics ---------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def machine_busy() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, all cores; total CPU seconds) from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    idle = vals[3] + vals[4]
    total = sum(vals[:8])
    return (total - idle) / CLK_TCK, total / CLK_TCK


def scrape(port: int) -> dict[str, float]:
    """etcd's Prometheus metrics as ``{'name{labels}': value}``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:  # noqa: S310 - loopback
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[name] = float(value)
    return out


def msum(m: dict[str, float], name: str, *needles: str) -> float:
    """Sum of the series of metric ``name`` whose labels contain every needle."""
    total = 0.0
    for k, v in m.items():
        base = k.split("{", 1)[0]
        if base == name and all(n in k for n in needles):
            total += v
    return total


# --- the simulated workers (one process holds many) ---------------------------------------------


def _next_due(due: float, now: float, every: float) -> float:
    """Keep the cadence, but never burst to catch up more than one period."""
    return due + every if now - due < every else now + every


class _Sim:
    """``count`` workers on one gRPC channel; commands on stdin, JSON lines on stdout.

    asyncio gRPC (a threaded sync client fell behind under load: its request-iterator thread and
    the scheduler fight over the GIL): keep-alives are written to one ``LeaseKeepAlive`` stream,
    puts are pipelined (64 in flight), one task drives both from a heap of due times.
    """

    def __init__(self, endpoint: str, first: int, count: int, ttl: int, progress_every: float, seed: int) -> None:
        from controller import keys

        self.endpoint = endpoint
        self.ttl = ttl
        self.ka_every = ttl / 3.0  # KeptLease: refresh at TTL/3
        self.progress_every = progress_every
        self.rng = random.Random(seed)
        self.ids = list(range(first, first + count))
        self.keys = {i: keys.member(JOB, GROUP, str(i)).encode() for i in self.ids}
        self.info: dict[int, dict[str, Any]] = {
            i: {
                "node": f"sim-node-{i // 8}",  # 8 workers per (simulated) node
                "pid": 100000 + i,
                "status": "ready",
                "version": 0,
                "engine": "vllm",
                "ray_node": f"{i // 8:056x}",
                "engine_start_s": 12.5,
            }
            for i in self.ids
        }
        self.lease: dict[int, int] = {}
        self.ka_req: dict[int, Any] = {}
        self.dead: set[int] = set()
        self.stats = Counter[str]()
        self.lags: list[float] = []
        self.heap: list[tuple[float, int, int]] = []  # (due, kind 0=keepalive 1=progress, worker)
        self.lock = threading.Lock()
        self.quit = threading.Event()
        self._out_lock = threading.Lock()

    def emit(self, obj: dict[str, Any]) -> None:
        with self._out_lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    def _command(self, line: str) -> None:
        parts = line.split()
        if not parts:
            return
        if parts[0] == "kill":
            ids = [int(x) for x in parts[1:]]
            with self.lock:
                self.dead.update(ids)
                t = time.time()
            self.emit({"killed": ids, "t": t})
        elif parts[0] == "stats":
            with self.lock:
                lags, self.lags = sorted(self.lags), []
                stats = dict(self.stats)
            p99 = lags[min(len(lags) - 1, int(0.99 * len(lags)))] if lags else 0.0
            self.emit({"stats": stats, "lag_p99": p99, "lag_max": lags[-1] if lags else 0.0})
        elif parts[0] == "quit":
            self.quit.set()

    def _stdin(self, loop: asyncio.AbstractEventLoop) -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(self._command, line)
        loop.call_soon_threadsafe(self._command, "quit")

    def _next_put(self, i: int) -> Any:
        from pyetcd import etcdrpc

        return etcdrpc.PutRequest(key=self.keys[i], value=self._value(i), lease=self.lease[i])

    def _value(self, i: int) -> bytes:
        """Worker ``i``'s next member value (its status flips between busy and idle)."""
        info = self.info[i]
        if info["status"] == "busy":
            info["status"] = "idle"
            info["shards_done"] = info.get("shards_done", 0) + 1
        elif info["status"] == "idle":
            info["status"] = "busy"
            info["step"] = info.get("step", -1) + 1
            info["shard"] = i % 16
        info["progress_at"] = time.time()
        return json.dumps(info).encode()

    async def run(self) -> None:
        import grpc
        from pyetcd import etcdrpc

        channel = grpc.aio.insecure_channel(self.endpoint)
        kv = etcdrpc.KVStub(channel)
        lease = etcdrpc.LeaseStub(channel)
        sem = asyncio.Semaphore(64)
        ka = lease.LeaseKeepAlive()  # opened first: a worker keep-alives from the moment its lease exists
        heap = self.heap

        async def register(i: int) -> None:
            async with sem:
                resp = await lease.LeaseGrant(etcdrpc.LeaseGrantRequest(TTL=self.ttl), timeout=30)
                self.lease[i] = resp.ID
                owner[resp.ID] = i
                self.ka_req[i] = etcdrpc.LeaseKeepAliveRequest(ID=resp.ID)
                now = time.monotonic()
                heapq.heappush(heap, (now + self.rng.uniform(0, self.ka_every), 0, i))
                await kv.Put(self._next_put(i), timeout=30)
                self.info[i]["status"] = "idle"
                heapq.heappush(heap, (now + self.rng.uniform(0, self.progress_every), 1, i))

        pending: set[asyncio.Task[None]] = set()
        owner: dict[int, int] = {}  # lease id -> worker
        rejoining: set[int] = set()

        async def rejoin(i: int) -> None:
            """What ``Registration`` does when its lease is lost: a fresh lease, the key written again."""
            try:
                async with sem:
                    resp = await lease.LeaseGrant(etcdrpc.LeaseGrantRequest(TTL=self.ttl), timeout=30)
                    self.lease[i] = resp.ID
                    owner[resp.ID] = i
                    self.ka_req[i] = etcdrpc.LeaseKeepAliveRequest(ID=resp.ID)
                    await kv.Put(self._next_put(i), timeout=30)
                self.stats["reregistered"] += 1
            except grpc.RpcError:
                self.stats["reregister_errors"] += 1
            finally:
                rejoining.discard(i)

        async def read_ka() -> None:
            while True:
                resp = await ka.read()
                if resp is grpc.aio.EOF:
                    return
                self.stats["ka_resp"] += 1
                if resp.TTL <= 0:
                    self.stats["ka_expired"] += 1
                    i = owner.get(resp.ID, -1)
                    if i >= 0 and i not in self.dead and i not in rejoining and self.lease.get(i) == resp.ID:
                        rejoining.add(i)
                        t = asyncio.create_task(rejoin(i))
                        pending.add(t)
                        t.add_done_callback(pending.discard)

        async def progress(i: int) -> None:
            try:
                async with sem:
                    await kv.Put(self._next_put(i), timeout=10)
                self.stats["puts"] += 1
            except grpc.RpcError:
                self.stats["put_errors"] += 1

        async def schedule() -> None:
            while not self.quit.is_set():
                now = time.monotonic()
                while heap and heap[0][0] <= now:
                    due, kind, i = heapq.heappop(heap)
                    if i in self.dead:
                        continue
                    heapq.heappush(
                        heap, (_next_due(due, now, self.ka_every if kind == 0 else self.progress_every), kind, i)
                    )
                    if kind == 0:
                        self.lags.append(now - due)
                        await ka.write(self.ka_req[i])
                        self.stats["ka_sent"] += 1
                    else:
                        t = asyncio.create_task(progress(i))
                        pending.add(t)
                        t.add_done_callback(pending.discard)
                await asyncio.sleep(min(0.05, max(0.0, heap[0][0] - time.monotonic())) if heap else 0.05)

        await self._serve(read_ka(), schedule(), [register(i) for i in self.ids], ka, channel)

    async def _serve(self, read_ka: Any, schedule: Any, registers: list[Any], ka: Any, channel: Any) -> None:
        """Register every worker (node), say ``ready``, then run until ``quit``."""
        reader = asyncio.create_task(read_ka)
        scheduler = asyncio.create_task(schedule)
        t0 = time.monotonic()
        await asyncio.gather(*registers)
        self.emit({"ready": len(self.ids), "pid": os.getpid(), "register_s": time.monotonic() - t0})
        threading.Thread(target=self._stdin, args=(asyncio.get_running_loop(),), daemon=True).start()
        while not self.quit.is_set():
            await asyncio.sleep(0.1)
        await scheduler
        reader.cancel()
        ka.cancel()
        await channel.close()


class _NodeSim(_Sim):
    """``--membership node``: what ``controller/nodeagent.py`` sends to etcd for these workers.

    One lease per simulated node (8 workers, ``i // 8``) kept alive at TTL/3. A worker's progress
    change marks its node dirty; a node writes its dirty keys in ONE Txn (a mod-revision compare
    per key, a put on the node's lease each), at once when its last write is at least
    ``BATCH_S`` old, else ``BATCH_S`` after it (the agent's rate limit). ``kill`` models a
    SIGSTOPped worker (the harder case: a killed one's connection ends and the agent deletes its
    key at once): its last ping was U(0, min(1, TTL/3)) s before the kill, and the agent deletes
    its key TTL s after that ping plus U(0, 0.1) (the agent's tick). ``killnode`` stops a whole
    node: its keep-alives stop, its lease expires with every key on it."""

    BATCH_S = AGENT_BATCH_S  # the agent's

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self.nodes = sorted({i // 8 for i in self.ids})
        self.node_lease: dict[int, int] = {}
        self.mod: dict[int, int] = {}
        self.dirty: dict[int, set[int]] = {nd: set() for nd in self.nodes}
        self.last_txn: dict[int, float] = dict.fromkeys(self.nodes, 0.0)
        self.flush_due: set[int] = set()
        self.dead_nodes: set[int] = set()

    def _command(self, line: str) -> None:
        parts = line.split()
        if parts and parts[0] == "killnode":
            nodes = [int(x) for x in parts[1:]]
            with self.lock:
                self.dead_nodes.update(nodes)
                ids = [i for i in self.ids if i // 8 in self.dead_nodes]
                self.dead.update(ids)
                t = time.time()
            self.emit({"killed": ids, "t": t, "nodes": nodes})
            return
        if parts and parts[0] == "kill":
            now = time.monotonic()
            for i in (int(x) for x in parts[1:]):
                ping = now - self.rng.uniform(0, min(1.0, self.ttl / 3.0))
                heapq.heappush(self.heap, (ping + self.ttl + self.rng.uniform(0, 0.1), 3, i))
        super()._command(line)

    async def run(self) -> None:
        import grpc
        from pyetcd import etcdrpc

        channel = grpc.aio.insecure_channel(self.endpoint)
        kv = etcdrpc.KVStub(channel)
        lease = etcdrpc.LeaseStub(channel)
        sem = asyncio.Semaphore(64)
        ka = lease.LeaseKeepAlive()
        heap = self.heap
        pending: set[asyncio.Task[None]] = set()
        owner: dict[int, int] = {}  # lease id -> node

        def spawn(coro: Any) -> None:
            t = asyncio.create_task(coro)
            pending.add(t)
            t.add_done_callback(pending.discard)

        def put(i: int) -> Any:
            return etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=self.keys[i], value=self._value(i),
                                                                     lease=self.node_lease[i // 8]))  # fmt: skip

        async def grant(nd: int) -> None:
            resp = await lease.LeaseGrant(etcdrpc.LeaseGrantRequest(TTL=self.ttl), timeout=30)
            self.node_lease[nd] = resp.ID
            owner[resp.ID] = nd
            self.ka_req[nd] = etcdrpc.LeaseKeepAliveRequest(ID=resp.ID)

        async def register(nd: int) -> None:
            """The agent's first writes: the node's workers take their keys (one Txn)."""
            async with sem:
                await grant(nd)
                ws = [i for i in self.ids if i // 8 == nd]
                resp = await kv.Txn(etcdrpc.TxnRequest(success=[put(i) for i in ws]), timeout=30)
                for i in ws:
                    self.mod[i] = resp.header.revision
                    self.info[i]["status"] = "idle"
                now = time.monotonic()
                heapq.heappush(heap, (now + self.rng.uniform(0, self.ka_every), 0, nd))
                for i in ws:
                    heapq.heappush(heap, (now + self.rng.uniform(0, self.progress_every), 1, i))

        async def flush(nd: int) -> None:
            ws = sorted(i for i in self.dirty[nd] if i not in self.dead)
            self.dirty[nd].clear()
            if not ws or nd in self.dead_nodes:
                return
            cmp = [etcdrpc.Compare(key=self.keys[i], target=etcdrpc.Compare.MOD, result=etcdrpc.Compare.EQUAL,
                                   mod_revision=self.mod[i]) for i in ws]  # fmt: skip
            try:
                async with sem:
                    resp = await kv.Txn(etcdrpc.TxnRequest(compare=cmp, success=[put(i) for i in ws]), timeout=10)
                self.stats["txns"] += 1
                self.stats["puts"] += len(ws)
                if resp.succeeded:
                    for i in ws:
                        self.mod[i] = resp.header.revision
                else:
                    self.stats["txn_failed"] += 1
            except grpc.RpcError:
                self.stats["put_errors"] += 1

        async def drop(i: int) -> None:
            """The agent deletes a silent worker's key (compared on its revision)."""
            cmp = [etcdrpc.Compare(key=self.keys[i], target=etcdrpc.Compare.MOD, result=etcdrpc.Compare.EQUAL,
                                   mod_revision=self.mod[i])]  # fmt: skip
            op = etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=self.keys[i]))
            try:
                async with sem:
                    await kv.Txn(etcdrpc.TxnRequest(compare=cmp, success=[op]), timeout=10)
                self.stats["dropped"] += 1
            except grpc.RpcError:
                self.stats["drop_errors"] += 1

        async def read_ka() -> None:
            while True:
                resp = await ka.read()
                if resp is grpc.aio.EOF:
                    return
                self.stats["ka_resp"] += 1
                if resp.TTL <= 0:
                    self.stats["ka_expired"] += 1

        async def schedule() -> None:
            while not self.quit.is_set():
                now = time.monotonic()
                while heap and heap[0][0] <= now:
                    due, kind, x = heapq.heappop(heap)
                    if kind == 0:  # a node's keep-alive
                        if x in self.dead_nodes:
                            continue
                        heapq.heappush(heap, (_next_due(due, now, self.ka_every), 0, x))
                        self.lags.append(now - due)
                        await ka.write(self.ka_req[x])
                        self.stats["ka_sent"] += 1
                    elif kind == 1:  # a worker's progress change: its node writes it, batched
                        if x in self.dead:
                            continue
                        heapq.heappush(heap, (_next_due(due, now, self.progress_every), 1, x))
                        nd = x // 8
                        self.dirty[nd].add(x)
                        if nd not in self.flush_due:
                            self.flush_due.add(nd)
                            heapq.heappush(heap, (max(now, self.last_txn[nd] + self.BATCH_S), 2, nd))
                    elif kind == 2:  # a node's batched write
                        self.flush_due.discard(x)
                        self.last_txn[x] = now
                        spawn(flush(x))
                    else:  # a silent worker's key deleted by its agent
                        spawn(drop(x))
                await asyncio.sleep(min(0.05, max(0.0, heap[0][0] - time.monotonic())) if heap else 0.05)

        await self._serve(read_ka(), schedule(), [register(nd) for nd in self.nodes], ka, channel)


# --- the controller process ---------------------------------------------------------------------


class _NullDriver:
    """What ``resilient_rl.job.runner``'s driver does per reconcile pass, minus its Ray loop, plus
    its watchdogs' membership reads: ``Controller.members`` of the workers' group once a second
    (the rollouts' progress view) and of the trainer group once a second (the lease channel),
    from a thread of its own as the runner's loop does."""

    def __init__(self, ctl: Any, job: str) -> None:
        self.desired: dict[str, Any] = {}
        self._stop = threading.Event()
        threading.Thread(target=self._watchdog, args=(ctl, job), name="bench-watchdog", daemon=True).start()

    def _watchdog(self, ctl: Any, job: str) -> None:
        while not self._stop.wait(1.0):
            try:
                ctl.members(job, GROUP)
                ctl.members(job, "trainer")
            except Exception as e:  # noqa: BLE001 - etcd not answering: the runner's "no news"
                print(f"watchdog read failed: {e}", file=sys.stderr)

    def reconcile(self, rec: Any) -> dict[str, Any] | None:
        self.desired = dict(rec.desired)
        return None

    def stop(self, final: bool) -> None:
        self._stop.set()


def _emitter() -> Any:
    out_lock = threading.Lock()

    def emit(obj: dict[str, Any]) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    return emit


def _until_quit() -> threading.Event:
    stop = threading.Event()

    def commands() -> None:
        for line in sys.stdin:
            if line.strip() == "quit":
                break
        stop.set()

    threading.Thread(target=commands, daemon=True).start()
    return stop


def _controller(endpoint: str) -> int:
    """The product's controller process: ``Controller.run()`` with the null driver."""
    from controller.service import Controller
    from controller.store import Store

    emit = _emitter()
    store = Store(endpoint)
    ctl = Controller(store, "scale-bench-ctl", driver_factory=lambda c, rec: _NullDriver(c, rec.id))
    threading.Thread(target=ctl.run, name="controller", daemon=True).start()
    stop = _until_quit()
    emit({"ready": True, "pid": os.getpid()})
    while not stop.wait(0.5):
        emit({"status": True, "leader": ctl.election.is_leader})
    ctl.stop()
    return 0


def _probe(endpoint: str) -> int:
    """The detection probe, a process of its own (its watch decodes every member event of the
    job, which the product's controller does not do: counted apart, as ``probe`` CPU): a
    ``MembershipView`` whose ``on_leave`` records the wall time each leave is seen."""
    from controller.membership import MembershipView
    from controller.store import Store

    emit = _emitter()
    store = Store(endpoint)

    def on_leave(group: str, worker: str, info: dict[str, Any]) -> None:
        emit({"leave": worker, "t": time.time()})

    view = MembershipView(store, JOB, on_leave=on_leave)
    stop = _until_quit()
    emit({"ready": True, "pid": os.getpid()})
    while not stop.wait(0.5):
        emit({"members": len(view)})
    view.close()
    return 0


# --- the orchestrator ---------------------------------------------------------------------------


class Child:
    """A child process speaking JSON lines on stdout; stopped by its PID."""

    def __init__(self, name: str, argv: list[str], log: Path) -> None:
        self.name = name
        self._log: IO[bytes] = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.p = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, cwd=common.ROOT, text=True
        )
        self.q: queue.Queue[dict[str, Any]] = queue.Queue()
        self.last: dict[str, Any] = {}
        threading.Thread(target=self._read, daemon=True).start()

    @property
    def pid(self) -> int:
        return self.p.pid

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            with contextlib.suppress(json.JSONDecodeError):
                msg = json.loads(line)
                if "members" in msg or "status" in msg:
                    self.last = msg  # periodic status: keep only the newest
                else:
                    self.q.put(msg)

    def send(self, line: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def expect(self, key: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self.p.poll() is not None:
                raise RuntimeError(f"{self.name} (pid {self.pid}): no {key!r} within {timeout:.0f} s")
            try:
                msg = self.q.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if key in msg:
                return msg

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.send("quit")
        try:
            self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.p.terminate()
            try:
                self.p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(timeout=5)
        self._log.close()


def _snapshot(port: int, pids: dict[str, int], sims: list[Child]) -> dict[str, Any]:
    for s in sims:
        s.send("stats")
    stats = [s.expect("stats", 30) for s in sims]
    busy, total = machine_busy()
    return {
        "t": time.monotonic(),
        "metrics": scrape(port),
        "cpu": {name: cpu_seconds(pid) for name, pid in pids.items()},
        "busy": busy,
        "total": total,
        "sim_stats": stats,
    }


def _window(a: dict[str, Any], b: dict[str, Any], n_sims: int) -> dict[str, Any]:
    """Rates between two snapshots."""
    dt = b["t"] - a["t"]
    ma, mb = a["metrics"], b["metrics"]

    def rate(name: str, *needles: str) -> float:
        return (msum(mb, name, *needles) - msum(ma, name, *needles)) / dt

    cpu = {k: (b["cpu"][k] - a["cpu"][k]) / dt for k in a["cpu"]}
    sim_cpu = sum(v for k, v in cpu.items() if k.startswith("sim"))
    fsync_n = rate("etcd_disk_wal_fsync_duration_seconds_count")
    fsync_s = rate("etcd_disk_wal_fsync_duration_seconds_sum")
    lag_p99 = max(s["lag_p99"] for s in b["sim_stats"])
    return {
        "seconds": dt,
        "controller_cpu": cpu["controller"],
        "probe_cpu": cpu["probe"],
        "etcd_cpu": cpu["etcd"],
        "sim_cpu": sim_cpu,
        "bench_cpu": cpu["bench"],
        "machine_busy_cores": (b["busy"] - a["busy"]) / dt,
        "machine_cores": (b["total"] - a["total"]) / dt,
        "etcd_req": rate("grpc_server_msg_received_total"),
        "puts": rate("etcd_debugging_mvcc_put_total"),
        "keepalives": rate("grpc_server_msg_received_total", 'grpc_method="LeaseKeepAlive"'),
        "ranges": rate("etcd_debugging_mvcc_range_total"),
        "txns": rate("etcd_debugging_mvcc_txn_total"),
        "watch_events": rate("etcd_debugging_mvcc_events_total"),
        "grpc_sent_bytes": rate("etcd_network_client_grpc_sent_bytes_total"),
        "wal_fsyncs": fsync_n,
        "wal_fsync_ms": 1000 * fsync_s / fsync_n if fsync_n else 0.0,
        "sim_ka_lag_p99_ms": 1000 * lag_p99,
        "sim_puts": sum(
            (sb["stats"].get("puts", 0) - sa["stats"].get("puts", 0))
            for sa, sb in zip(a["sim_stats"], b["sim_stats"], strict=True)
        )
        / dt,
        "sim_errors": sum(sb["stats"].get("put_errors", 0) for sb in b["sim_stats"]),
        "reregistered": sum(sb["stats"].get("reregistered", 0) for sb in b["sim_stats"]),
        "sim_keepalives": sum(
            (sb["stats"].get("ka_sent", 0) - sa["stats"].get("ka_sent", 0))
            for sa, sb in zip(a["sim_stats"], b["sim_stats"], strict=True)
        )
        / dt,
        "load_avg_1m": os.getloadavg()[0],
    }


def _profile_summary(raw: str, top: int = 12) -> dict[str, Any]:
    """Collapsed py-spy stacks -> samples per controller activity and the top self/inclusive frames."""
    activity: Counter[str] = Counter()
    self_t: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    rules = [
        ("reconcile loop (jobs.list_all: range + JSON of every key)", "_lead ("),
        ("membership view (_apply: JSON + callbacks)", "MembershipView._run"),
        ("watch thread (iterate the gRPC stream, WatchEvent -> queue)", "Watch._run"),
        ("gRPC channel thread (receive, deserialize, wake the reader)", "channel_spin"),
        ("lease keep-alive threads", "KeptLease._run"),
        ("election", "Election."),
    ]
    for line in raw.splitlines():
        stack, _, cnt = line.rpartition(" ")
        if not stack or not cnt.isdigit():
            continue
        c = int(cnt)
        total += c
        frames = [
            f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0] + ")" if " (" in f else f for f in stack.split(";")
        ]
        for label, needle in rules:
            if needle in stack:
                activity[label] += c
                break
        else:
            activity["other"] += c
        self_t[frames[-1]] += c
        for f in set(frames):
            incl[f] += c
    return {
        "samples": total,
        "activity": dict(activity.most_common()),
        "self": self_t.most_common(top),
        "inclusive": incl.most_common(top),
    }


def run_once(n: int, rep: int, args: argparse.Namespace, profile: bool) -> dict[str, Any]:
    from controller import jobs, keys
    from controller.store import Store
    from resilient_rl.local import free_ports, start_etcd

    tmp = Path(tempfile.mkdtemp(prefix="rrl-scale-"))
    etcd = None
    children: list[Child] = []
    store = None
    try:
        port, peer = free_ports(2)
        etcd = start_etcd(tmp / "etcd", port, peer, tmp / "etcd.log")
        endpoint = f"127.0.0.1:{port}"
        store = Store(endpoint)
        spec = {"name": JOB, "note": "controller-scale benchmark: no RL driver"}
        jobs.submit(store, JOB, json.dumps(spec), {"rollout": n, "trainer": 0})
        me = [sys.executable, "-m", "bench.controller_scale"]
        ctl = Child("controller", [*me, "--role", "controller", "--endpoint", endpoint], tmp / "controller.log")
        children.append(ctl)
        ctl.expect("ready", 60)
        probe = Child("probe", [*me, "--role", "probe", "--endpoint", endpoint], tmp / "probe.log")
        children.append(probe)
        probe.expect("ready", 60)
        k = args.sim_procs
        sims: list[Child] = []
        t0 = time.monotonic()
        for j in range(k):
            first, last = j * n // k, (j + 1) * n // k
            argv = [*me, "--role", "sim", "--endpoint", endpoint, "--first", str(first), "--count", str(last - first)]
            argv += ["--ttl", str(args.ttl), "--progress-every", str(args.progress_every), "--seed", str(rep * 100 + j)]
            argv += ["--membership", args.membership]
            sims.append(Child(f"sim{j}", argv, tmp / f"sim{j}.log"))
        children.extend(sims)
        reg = [s.expect("ready", 300) for s in sims]
        print(f"  n={n} rep {rep + 1}: simulators registered in {max(r['register_s'] for r in reg):.1f} s", flush=True)
        deadline = time.monotonic() + 120
        next_note = time.monotonic() + 10
        while probe.last.get("members") != n or not ctl.last.get("leader"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"controller {ctl.last}, probe {probe.last} after 120 s: expected {n} members "
                                   "and leadership")  # fmt: skip
            if time.monotonic() > next_note:
                for s in sims:
                    s.send("stats")
                st = [s.expect("stats", 30) for s in sims]
                print(f"  waiting: controller {ctl.last}, probe {probe.last}, simulators {st}", flush=True)
                next_note += 10
            time.sleep(0.2)
        startup = time.monotonic() - t0
        print(f"  n={n} rep {rep + 1}: {n} workers registered and seen in {startup:.1f} s; warm-up", flush=True)
        time.sleep(args.warmup)
        pids = {"etcd": etcd.pid, "controller": ctl.pid, "probe": probe.pid, "bench": os.getpid()}
        pids.update({s.name: s.pid for s in sims})
        s0 = _snapshot(port, pids, sims)
        time.sleep(args.window)
        s1 = _snapshot(port, pids, sims)
        steady = _window(s0, s1, k)
        steady["etcd_rss_mib"] = rss_mib(etcd.pid)
        steady["controller_rss_mib"] = rss_mib(ctl.pid)
        kvs, _ = store.range(keys.members(JOB))
        steady["member_kv_bytes"] = statistics.mean(len(kv.key) + len(kv.value) for kv in kvs) if kvs else 0.0
        print(
            f"  steady {steady['seconds']:.1f} s: controller {steady['controller_cpu']:.3f} CPU s/s, "
            f"etcd {steady['etcd_cpu']:.3f} CPU s/s, sims {steady['sim_cpu']:.3f}, etcd {steady['etcd_req']:.0f} req/s "
            f"({steady['puts']:.0f} puts, {steady['keepalives']:.0f} keepalives, {steady['ranges']:.1f} ranges/s), "
            f"machine busy {steady['machine_busy_cores']:.2f} cores",
            flush=True,
        )
        # the kill: 1 % of the workers, spread over the simulators by their ranges
        rng = random.Random(1000 + rep)
        victims = sorted(rng.sample(range(n), max(1, n // 100)))
        by_sim: dict[int, list[int]] = {}
        for v in victims:
            j = next(j for j in range(k) if j * n // k <= v < (j + 1) * n // k)
            by_sim.setdefault(j, []).append(v)
        node_victims: list[str] = []
        s2 = _snapshot(port, pids, sims)
        for j, vs in by_sim.items():
            sims[j].send("kill " + " ".join(map(str, vs)))
        kill_t: dict[str, float] = {}
        for j in by_sim:
            msg = sims[j].expect("killed", 30)
            kill_t.update({str(v): msg["t"] for v in msg["killed"]})
        if args.membership == "node":  # and one whole node (its agent and workers) stopped
            first, last = 0, n // k
            nodes = [nd for nd in range((first + 7) // 8, last // 8) if not any(v // 8 == nd for v in victims)]
            nd = rng.choice(nodes)
            sims[0].send(f"killnode {nd}")
            msg = sims[0].expect("nodes", 30)
            node_victims = [str(v) for v in msg["killed"]]
            kill_t.update(dict.fromkeys(node_victims, msg["t"]))
        leave_t: dict[str, float] = {}
        deadline = time.monotonic() + 4 * args.ttl + 10
        while len(set(kill_t) & set(leave_t)) < len(kill_t) and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                msg = probe.q.get(timeout=0.2)
                if "leave" in msg:
                    leave_t.setdefault(msg["leave"], msg["t"])
        s3 = _snapshot(port, pids, sims)
        kill = _window(s2, s3, k)
        while True:  # late leaves (false ones included) that came with the last snapshot
            try:
                msg = probe.q.get_nowait()
            except queue.Empty:
                break
            if "leave" in msg:
                leave_t.setdefault(msg["leave"], msg["t"])
        # the workers stopped one by one; those of the stopped node apart
        lat = sorted(leave_t[w] - kill_t[w] for w in kill_t if w in leave_t and w not in node_victims)
        node_lat = sorted(leave_t[w] - kill_t[w] for w in node_victims if w in leave_t)
        missed = [w for w in kill_t if w not in leave_t]
        false_leaves = sorted(w for w in leave_t if w not in kill_t)

        def pct(q: float) -> float:
            return lat[min(len(lat) - 1, round(q * (len(lat) - 1)))] if lat else float("nan")

        det = {
            "node_killed": len(node_victims),
            "node_seen": len(node_lat),
            "node_max": node_lat[-1] if node_lat else float("nan"),
            "killed": len(victims),
            "seen": len(lat),
            "missed": len(missed),
            "false_leaves": len(false_leaves),
            "p50": pct(0.5),
            "p99": pct(0.99),
            "min": lat[0] if lat else float("nan"),
            "max": lat[-1] if lat else float("nan"),
        }
        if node_victims:
            print(f"  a whole node stopped ({len(node_victims)} workers): all seen {len(node_lat)}, "
                  f"the last after {det['node_max']:.2f} s", flush=True)  # fmt: skip
        print(
            f"  kill {len(victims)}: detection p50 {det['p50']:.2f} s, p99 {det['p99']:.2f} s "
            f"(min {det['min']:.2f}, max {det['max']:.2f}; missed {len(missed)}, false leaves {len(false_leaves)}); "
            f"controller {kill['controller_cpu']:.3f} CPU s/s over the {kill['seconds']:.1f} s kill window",
            flush=True,
        )
        result: dict[str, Any] = {
            "n": n,
            "rep": rep,
            "startup_s": startup,
            "steady": steady,
            "kill": kill,
            "detection": det,
            "latencies": lat,
        }
        if false_leaves:  # leases expired without a kill: the simulators fell behind, the figures mean nothing
            raise RuntimeError(
                f"{len(false_leaves)} workers' leases expired without a kill (simulator keep-alives fell "
                "behind on this machine): run not counted"
            )
        if profile:
            raw = tmp / "profile.txt"
            print(f"  profiling the controller (pid {ctl.pid}) with py-spy for {args.profile_seconds} s", flush=True)
            spy = Path(sys.executable).parent / "py-spy"
            r = subprocess.run(
                [str(spy), "record", "--pid", str(ctl.pid), "--duration", str(args.profile_seconds), "--rate", "100"]
                + ["--nonblocking", "--gil", "--format", "raw", "--output", str(raw)],
                capture_output=True,
                text=True,
                check=False,
            )
            if raw.exists():
                result["profile"] = _profile_summary(raw.read_text())
                result["profile"]["seconds"] = args.profile_seconds
                result["profile"]["rate"] = 100
            else:
                result["profile_error"] = (r.stderr or r.stdout)[-2000:]
                print(f"  py-spy failed: {result['profile_error'][-300:]}", flush=True)
        return result
    except BaseException:
        for log in sorted(tmp.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-15:]
            print(f"--- {log.name} (last lines)\n" + "\n".join(tail), file=sys.stderr)
        raise
    finally:
        for c in reversed(children):
            c.stop()
        if store is not None:
            store.close()
        if etcd is not None:
            etcd.stop()
        shutil.rmtree(tmp, ignore_errors=True)


# --- report -------------------------------------------------------------------------------------


def _s(runs: list[dict[str, Any]], path: str) -> dict[str, float]:
    vals = []
    for r in runs:
        x: Any = r
        for p in path.split("."):
            x = x[p]
        vals.append(float(x))
    return common.summary(vals)


def _extrapolate(
    by_n: dict[int, list[dict[str, Any]]], args: argparse.Namespace, target: int
) -> tuple[str, dict[str, Any]]:
    """Per-worker costs: the least-squares slope of each figure's medians over the measured sizes
    (so fixed costs drop out), scaled from the largest size to ``target``."""
    sizes = sorted(by_n)
    hi = sizes[-1]
    lo = sizes[0] if len(sizes) > 1 else 0
    med = {n: {k: _s(by_n[n], f"steady.{k}")["median"] for k in by_n[n][0]["steady"]} for n in sizes}

    def slope(k: str) -> float:
        if lo == 0:
            return med[hi][k] / hi
        mean_n = statistics.mean(sizes)
        mean_y = statistics.mean(med[n][k] for n in sizes)
        return sum((n - mean_n) * (med[n][k] - mean_y) for n in sizes) / sum((n - mean_n) ** 2 for n in sizes)

    def at(k: str) -> float:
        return med[hi][k] + slope(k) * (target - hi)

    node = args.membership == "node"  # a lease and at most one Txn per BATCH_S per node of 8
    ka_rate = target / (8 if node else 1) / (args.ttl / 3.0)
    put_rate = target / args.progress_every  # member values written (watch events)
    proposals = min(put_rate, target / 8 / _NodeSim.BATCH_S) if node else put_rate
    ctl_cpu, etcd_cpu = at("controller_cpu"), at("etcd_cpu")
    per = {
        "controller_cpu_per_worker_ms": 1000 * slope("controller_cpu"),
        "etcd_cpu_per_worker_ms": 1000 * slope("etcd_cpu"),
        "etcd_req_per_worker": slope("etcd_req"),
        "etcd_cpu_per_req_us": 1e6 * slope("etcd_cpu") / slope("etcd_req") if slope("etcd_req") else float("nan"),
        "grpc_sent_bytes_per_worker": slope("grpc_sent_bytes"),
    }
    # the reconcile loop's range: every member value, twice a second
    value_bytes = med[hi]["member_kv_bytes"]  # measured: mean key + value of the member keys in etcd
    range_mb = target * value_bytes / 1e6
    est = {
        "target": target,
        "keepalives_per_s": ka_rate,
        "puts_per_s": put_rate,
        "controller_cpu": ctl_cpu,
        "etcd_cpu": etcd_cpu,
        "etcd_req": at("etcd_req"),
        "grpc_sent_mb_per_s": at("grpc_sent_bytes") / 1e6,
        "range_mb_per_pass": range_mb,
        **per,
    }
    lines = [
        f"Per-worker cost = least-squares slope over {', '.join(f'{n:,}' for n in sizes)} workers (medians of the "
        "steady windows), so fixed costs drop out:",
        "",
        f"- controller: {per['controller_cpu_per_worker_ms']:.3f} ms CPU per second per worker; "
        f"etcd: {per['etcd_cpu_per_worker_ms']:.3f} ms CPU/s per worker, {per['etcd_req_per_worker']:.3f} requests/s "
        f"per worker ({per['etcd_cpu_per_req_us']:.0f} us of etcd CPU per request, puts and keep-alives and the "
        f"controller's ranges together); etcd sends {per['grpc_sent_bytes_per_worker'] / 1e3:.1f} kB/s per worker "
        "(the watch events of the progress puts).",
        "",
        f"At {target:,} workers (same cadences: keep-alive every {args.ttl / 3:.2f} s, a progress put every "
        f"{args.progress_every:g} s; membership: {args.membership}):",
        "",
        f"- etcd requests: {ka_rate:,.0f} keep-alives/s (a lease per {'node of 8' if node else 'worker'}) + "
        f"{proposals:,.0f} {'batched Txns' if node else 'puts'}/s carrying {put_rate:,.0f} member values (each "
        f"request a raft proposal + WAL append) = {ka_rate + proposals:,.0f} req/s (linear: {est['etcd_req']:,.0f});",
        f"- etcd CPU: {med[hi]['etcd_cpu']:.2f} + {per['etcd_cpu_per_worker_ms']:.3f} ms x {target - hi:,} = "
        f"**{etcd_cpu:.1f} cores**;",
        f"- controller CPU: {med[hi]['controller_cpu']:.2f} + {per['controller_cpu_per_worker_ms']:.3f} ms x "
        f"{target - hi:,} = **{ctl_cpu:.1f} cores** in ONE Python process (the GIL caps its Python work at one "
        "core);",
        f"- {put_rate:,.0f} member values change a second ({target:,} x {value_bytes:.0f} B put every "
        f"{args.progress_every:g} s, {put_rate * value_bytes / 1e6:.0f} MB/s). The product's controller runs no "
        "watch on them: the runner reads its groups once a second as a delta of its last read (the changed "
        "values only, since 2026-12-03), and the reconcile loop's cost no longer grows with the workers "
        f"(before 2f37a03 it read every member twice a second: {range_mb:.0f} MB per pass at this size). The "
        "bench's detection probe, a process of its own, watches every event;",
        f"- etcd's gRPC send: {est['grpc_sent_mb_per_s']:.0f} MB/s (linear).",
    ]
    # where each resource saturates, from the same linear model
    cores = os.cpu_count() or 1

    def n_at(k: str, limit: float) -> float:
        sl = slope(k)
        return hi + (limit - med[hi][k]) / sl if sl > 0 else float("inf")

    n_ctl = n_at("controller_cpu", 1.0)
    n_etcd_here = n_at("etcd_cpu", float(cores))
    n_etcd_16 = n_at("etcd_cpu", 16.0)
    est.update({"n_controller_1core": n_ctl, "n_etcd_all_cores_here": n_etcd_here, "n_etcd_16_cores": n_etcd_16})
    first = "the controller's single Python process" if n_ctl < n_etcd_16 else "etcd's CPU"
    lines += [
        "",
        "Which runs out first (same linear model): the controller reaches one core (its Python work is "
        f"GIL-bound) at ~{n_ctl:,.0f} workers; etcd needs all {cores} cores of this machine at ~{n_etcd_here:,.0f} "
        f"workers and 16 dedicated cores at ~{n_etcd_16:,.0f}. So **{first}** gives out first. Beyond CPU, etcd is "
        "one raft log: every progress put is a proposal, applied serially, and every keep-alive is a "
        "message on a long-lived stream (the product's `Store` and the simulator both multiplex); at 100,000 "
        f"workers that is {ka_rate:,.0f} keep-alives/s on top of {proposals:,.0f} proposals/s.",
        "",
        "What the design would change, in order of effect:",
        "",
        "0. (Done in 2f37a03, after the first run of this benchmark showed it at 43-52 % of the controller's "
        "samples at 1,000 workers.) The reconcile loop no longer reads members: `jobs.list_all(detail=False)` "
        "reads one key per job to find the ids and a txn of spec/desired/state per job.",
        "1. (Done 2026-12-03.) One long-lived keep-alive stream per process in `Store`.",
        "2. (Built 2026-12-03: `fault.membership: node`, `controller/nodeagent.py`; `--membership node` "
        "measures it.) One lease per node, not per worker: a node agent holds one lease for all workers on "
        "the node (8 GPUs -> 8 workers), keep-alives drop 8x, on one long-lived stream.",
        "3. (Built with 2.) Progress through the node agent, batched: one Txn per node per second at most, "
        "carrying every change of its workers since the last one.",
        "4. Shard the membership prefix (`members/{group}/{shard}/...`) and run one watcher per shard (threads "
        "in separate processes, or several controllers each owning shards), so no single Python consumer "
        "decodes every event.",
    ]
    return "\n".join(lines), est


def report(runs: list[dict[str, Any]], args: argparse.Namespace, mach: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    by_n: dict[int, list[dict[str, Any]]] = {}
    for r in runs:
        by_n.setdefault(r["n"], []).append(r)
    rows = []
    for n in sorted(by_n):
        rs = by_n[n]
        rows.append(
            [
                f"{n:,}",
                common.fmt(_s(rs, "detection.p50")),
                common.fmt(_s(rs, "detection.p99")),
                common.fmt(_s(rs, "steady.controller_cpu"), 3),
                common.fmt(_s(rs, "kill.controller_cpu"), 3),
                common.fmt(_s(rs, "steady.etcd_cpu"), 3),
                common.fmt(_s(rs, "steady.etcd_req"), 0),
                common.fmt(_s(rs, "steady.puts"), 0),
                common.fmt(_s(rs, "steady.keepalives"), 0),
                common.fmt(_s(rs, "detection.node_max")) if args.membership == "node" else "-",
            ]
        )
    main = common.table(
        [
            "workers",
            "detection p50 s",
            "detection p99 s",
            "controller CPU s/s (steady)",
            "controller CPU s/s (kill window)",
            "etcd CPU s/s",
            "etcd req/s",
            "puts/s",
            "keepalives/s",
            "whole node stopped: last of 8 seen s",
        ],
        rows,
    )
    rows2 = []
    for n in sorted(by_n):
        rs = by_n[n]
        rows2.append(
            [
                f"{n:,}",
                common.fmt(_s(rs, "steady.probe_cpu"), 3),
                common.fmt(_s(rs, "steady.ranges"), 1),
                common.fmt(_s(rs, "steady.watch_events"), 0),
                common.fmt(
                    {k: v / 1e6 for k, v in _s(rs, "steady.grpc_sent_bytes").items() if k != "n"} | {"n": len(rs)}, 1
                ),
                common.fmt(_s(rs, "steady.wal_fsyncs"), 0),
                common.fmt(_s(rs, "steady.wal_fsync_ms"), 2),
                common.fmt(_s(rs, "steady.etcd_rss_mib"), 0),
                common.fmt(_s(rs, "steady.controller_rss_mib"), 0),
                common.fmt(_s(rs, "steady.sim_cpu"), 3),
                common.fmt(_s(rs, "steady.sim_ka_lag_p99_ms"), 1),
                common.fmt(_s(rs, "steady.machine_busy_cores"), 2),
                common.fmt(_s(rs, "steady.load_avg_1m"), 1),
                f"{sum(r['detection']['false_leaves'] for r in rs)} / {sum(r['detection']['missed'] for r in rs)} / "
                f"{sum(r['kill']['reregistered'] for r in rs)}",
                common.fmt(_s(rs, "startup_s"), 1),
            ]
        )
    side = common.table(
        [
            "workers",
            "probe CPU s/s",
            "ranges/s",
            "watch events/s",
            "etcd sent MB/s",
            "WAL fsyncs/s",
            "fsync ms",
            "etcd RSS MiB",
            "controller RSS MiB",
            "simulators CPU s/s",
            "sim keep-alive lag p99 ms",
            "machine busy cores",
            "load avg 1m",
            "false / missed leaves / re-registrations",
            "start-up s",
        ],
        rows2,
    )
    extra, est = _extrapolate(by_n, args, 100_000)
    prof = next((r["profile"] for r in runs if "profile" in r), None)
    prof_md = ""
    if prof:
        tot = max(1, prof["samples"])
        secs = prof["seconds"]
        lines = [
            f"py-spy, {prof['rate']} Hz for {secs} s on the controller at {max(by_n):,} workers (steady state after the "
            f"kill; `--gil`: only the thread holding the GIL is sampled): {tot} samples = {tot / prof['rate'] / secs:.2f} CPU s/s "
            "of GIL-held Python time (the rest of the process's CPU is gRPC's C threads).",
            "",
            common.table(
                ["activity", "share of samples"],
                [[k, f"{100 * v / tot:.0f} %"] for k, v in prof["activity"].items()],
            ),
            "",
            "Top frames by self time: " + "; ".join(f"`{f}` {100 * c / tot:.0f} %" for f, c in prof["self"][:8]),
        ]
        prof_md = "\n".join(lines)
    mode = (
        "(a lease and one batched Txn per node of 8, as `controller/nodeagent.py` writes; a killed worker is a "
        "stopped one, its key deleted after the TTL; and one whole node stopped, its lease left to expire)"
        if args.membership == "node"
        else "(a lease and a put per worker)"
    )
    md = [
        "# Controller scale: simulated workers against one etcd and the real controller",
        "",
        f"Command: `{common.command_line()}`",
        "",
        f"Machine: {common.machine_line(mach)}",
        "",
        f"Each figure: median (min-max) over {args.repeats} runs, each with a fresh etcd, controller and "
        f"simulators. Lease TTL {args.ttl} s, keep-alive every {args.ttl / 3:.2f} s (KeptLease), one progress put per "
        f"worker every {args.progress_every:g} s, {args.sim_procs} simulator processes (one gRPC channel and one "
        f"multiplexed keep-alive stream each), steady window {args.window:g} s, 1 % of the workers killed. "
        f"Membership: **{args.membership}** {mode}. "
        "The controller process runs `Controller.run()` (election + reconcile loop every 0.5 s, the runner's "
        "membership reads); the detection probe (a `MembershipView`) is a process of its own, its CPU apart "
        "(see the module docstring of `bench/controller_scale.py`).",
        "",
        main,
        "",
        "Alongside (steady window):",
        "",
        side,
        "",
        "## Extrapolation to 100,000 workers (on paper)",
        "",
        extra,
        "",
        "## Controller profile",
        "",
        prof_md or "(not profiled: run with --profile)",
        "",
    ]
    return "\n".join(md), est


# --- entry point --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench scale", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[500, 1000, 2000, 5000],
        help="numbers of simulated workers (5,000 needs more than 2 cores for the simulators)",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ttl", type=int, default=5, help="lease TTL, s (Registration's default)")
    ap.add_argument("--progress-every", type=float, default=5.0, help="seconds between progress puts per worker")
    ap.add_argument("--sim-procs", type=int, default=2, help="simulator processes")
    ap.add_argument(
        "--membership",
        choices=["worker", "node"],
        default="worker",
        help="worker: a lease and a put per worker (Registration); node: a lease and one batched Txn per "
        "node of 8 (controller/nodeagent.py), and one whole node stopped in the kill window",
    )
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--window", type=float, default=20.0, help="steady measurement window, s")
    ap.add_argument("--profile", action="store_true", help="py-spy the controller once, at the largest size")
    ap.add_argument("--profile-seconds", type=int, default=15)
    ap.add_argument("--no-save", action="store_true", help="do not write bench/results/scale.{json,md}")
    # internal: the child processes
    ap.add_argument("--role", choices=["bench", "sim", "controller", "probe"], default="bench", help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", help=argparse.SUPPRESS)
    ap.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role == "sim":
        sim = _NodeSim if args.membership == "node" else _Sim
        asyncio.run(sim(args.endpoint, args.first, args.count, args.ttl, args.progress_every, args.seed).run())
        return 0
    if args.role == "controller":
        return _controller(args.endpoint)
    if args.role == "probe":
        return _probe(args.endpoint)

    mach = common.machine()
    print(f"controller scale: sizes {args.sizes}, {args.repeats} repeats; {common.machine_line(mach)}", flush=True)
    runs: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    t0 = time.monotonic()
    for n in args.sizes:
        for rep in range(args.repeats):
            profile = args.profile and n == max(args.sizes) and rep == args.repeats - 1
            try:
                runs.append(run_once(n, rep, args, profile))
            except (RuntimeError, OSError) as e:  # an overloaded machine: record it, go on
                print(f"  n={n} rep {rep + 1} FAILED: {e}", flush=True)
                failed.append({"n": n, "rep": rep, "error": str(e)})
    if not runs:
        print("no run succeeded", file=sys.stderr)
        return 1
    md, est = report(runs, args, mach)
    if failed:
        md += (
            "\nFailed runs (not in the figures): "
            + "; ".join(f"n={f['n']} rep {f['rep'] + 1}: {f['error']}" for f in failed)
            + "\n"
        )
    print(md)
    print(f"total {time.monotonic() - t0:.0f} s", flush=True)
    if not args.no_save:
        path = common.save(
            "scale",
            {
                "args": {k: v for k, v in vars(args).items() if k not in ("role", "endpoint", "first", "count")},
                "runs": runs,
                "failed": failed,
                "extrapolation": est,
                "median_latency_all": statistics.median([x for r in runs for x in r["latencies"]] or [float("nan")]),
            },
        )
        path.with_suffix(".md").write_text(md)
        print(f"wrote {path} and {path.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
