"""`rrl cancel` takes effect while the job's driver is busy: the leader's reconcile loop writes
CANCELLED (fenced) at once, and the driver's later writes (a step commit, a final phase) are
refused by the phase checks the runner uses. Real etcd and a real Controller; the driver is a
stand-in whose thread is stuck in work it cannot be interrupted from (the outer edge faked)."""

from __future__ import annotations

import threading
import time

import pytest

from controller import jobs
from controller.election import NotLeader
from controller.service import Controller
from resilient_rl.cli import _validate_spec
from tests.conftest import EtcdServer


class BusyDriver:
    """Like a JobRunner whose thread is inside an uninterruptible computation for ``busy_s``,
    then tries to commit step 0 and to finish, as the runner does (same ``expect`` checks)."""

    def __init__(self, controller: Controller, rec: jobs.JobRecord, busy_s: float) -> None:
        from resilient_rl.job.runner import committable, live

        self.c, self.job, self.outcome = controller, rec.id, []  # type: ignore[var-annotated]
        self.c.update_state(self.job, expect=live, phase="RUNNING")

        def body() -> None:
            time.sleep(busy_s)  # ignores stop(): a Python thread cannot be interrupted
            for what, expect, change in (
                ("commit", lambda cur: committable(cur, 0), {"step": 1}),
                ("finish", live, {"phase": "SUCCEEDED"}),
            ):
                try:
                    self.c.update_state(self.job, expect=expect, **change)
                    self.outcome.append((what, "written"))
                except NotLeader as e:
                    self.outcome.append((what, str(e)))

        self.thread = threading.Thread(target=body, daemon=True)
        self.thread.start()
        self.stopped_final: bool | None = None

    def reconcile(self, rec: jobs.JobRecord) -> None:
        return None

    def stop(self, final: bool) -> None:
        self.stopped_final = final  # does not wait for the busy thread


@pytest.mark.slow
def test_cancel_takes_effect_while_the_driver_is_busy_and_its_late_writes_are_refused(etcd: EtcdServer) -> None:
    store = etcd.store()
    drivers: list[BusyDriver] = []

    def factory(c: Controller, rec: jobs.JobRecord) -> BusyDriver:
        drivers.append(BusyDriver(c, rec, busy_s=6.0))
        return drivers[-1]

    c = Controller(store, "ctl-a", ttl=2, driver_factory=factory, interval=0.2)
    t = threading.Thread(target=c.run, daemon=True)
    t.start()
    try:
        job_id, spec_json, desired = _validate_spec(
            {"name": "busy", "model": {"init": {}}, "rollout": {"engine": "hf"}, "steps": 5}
        )
        jobs.submit(store, job_id, spec_json, desired)
        deadline = time.monotonic() + 10
        while not drivers or jobs.get(store, "busy").phase != "RUNNING":
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.05)
        t0 = time.monotonic()
        jobs.cancel(store, "busy")
        while jobs.get(store, "busy").phase != "CANCELLED":
            assert time.monotonic() - t0 < 3, f"cancel did not take effect: {jobs.get(store, 'busy').phase}"
            time.sleep(0.05)
        while drivers[0].stopped_final is None:  # the reconcile loop stops the driver after the write
            assert time.monotonic() - t0 < 3, "the driver was not stopped"
            time.sleep(0.05)
        assert drivers[0].stopped_final is True
        assert drivers[0].thread.is_alive()  # still busy: the cancel did not wait for it
        drivers[0].thread.join(timeout=15)
        rec = jobs.get(store, "busy")
        assert rec.phase == "CANCELLED" and rec.state["step"] == 0, rec.state
        assert drivers[0].outcome == [
            ("commit", "job is CANCELLED: step 0 is not committed"),
            ("finish", "job is CANCELLED: the runner does not write its state any more"),
        ]
    finally:
        c.stop()
        t.join(timeout=10)


class IdleDriver:
    def __init__(self, controller: Controller, rec: jobs.JobRecord) -> None:
        controller.update_state(rec.id, phase="RUNNING")

    def reconcile(self, rec: jobs.JobRecord) -> None:
        return None

    def stop(self, final: bool) -> None:
        pass


@pytest.mark.slow
def test_an_etcd_outage_is_an_event_pair_with_its_length(etcd: EtcdServer) -> None:
    import os
    import signal

    from controller import events

    store = etcd.store()
    c = Controller(etcd.store(timeout=0.5, retry_window=1.0), "ctl-a", ttl=2, driver_factory=IdleDriver,
                   interval=0.2)  # fmt: skip
    t = threading.Thread(target=c.run, daemon=True)
    t.start()
    try:
        job_id, spec_json, desired = _validate_spec({"name": "calm", "model": {"init": {}}, "steps": 5})
        jobs.submit(store, job_id, spec_json, desired)
        deadline = time.monotonic() + 10
        while jobs.get(store, "calm").phase != "RUNNING":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert etcd.proc is not None
        os.kill(etcd.proc.pid, signal.SIGSTOP)
        time.sleep(4)
        os.kill(etcd.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while True:
            evs = {e["kind"]: e for e in events.read(store, "calm", limit=100)}
            if "etcd_back" in evs:
                break
            assert time.monotonic() < deadline, sorted(evs)
            time.sleep(0.2)
        assert "etcd_lost" in evs and evs["etcd_lost"]["since"] == evs["etcd_back"]["since"]
        assert 2.5 <= evs["etcd_back"]["seconds"] <= 30, evs["etcd_back"]
        assert evs["etcd_back"]["message"].startswith("etcd reachable again after")
    finally:
        c.stop()
        t.join(timeout=10)


@pytest.mark.slow
def test_a_job_that_kills_its_leader_twice_is_quarantined_until_resumed(etcd: EtcdServer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    from controller import events
    from tests.conftest import REPO

    store = etcd.store()
    flag = tmp_path / "poison"
    flag.touch()
    job_id, spec_json, desired = _validate_spec({"name": "poison", "model": {"init": {}}, "steps": 5})
    jobs.submit(store, job_id, spec_json, desired)
    procs: list[subprocess.Popen[bytes]] = []

    def controller(cid: str) -> subprocess.Popen[bytes]:
        p = subprocess.Popen([sys.executable, "-m", "tests.helpers.poison_controller", etcd.endpoint, cid, str(flag)],
                             cwd=REPO, start_new_session=True)  # fmt: skip
        procs.append(p)
        return p

    try:
        for cid in ("poison-a", "poison-b"):  # each leads, starts the job's driver, and dies of it
            assert controller(cid).wait(timeout=60) == -9, cid
        c = controller("poison-c")  # the third leader refuses to run it
        deadline = time.monotonic() + 60
        while (rec := jobs.get(store, "poison")).phase != "QUARANTINED":
            assert c.poll() is None, "the third controller died too: the job was not quarantined"
            assert time.monotonic() < deadline, rec.state
            time.sleep(0.1)
        assert rec.state["runner_strikes"] == 2 and "died or stepped down 2 times in a row" in rec.state["reason"]
        assert "`rrl resume poison`" in rec.state["reason"]
        time.sleep(2)
        assert c.poll() is None and jobs.get(store, "poison").phase == "QUARANTINED"  # it stays so
        flag.unlink()  # the job is mended; the operator resumes it
        jobs.resume(store, "poison")
        while jobs.get(store, "poison").phase != "RUNNING":
            assert time.monotonic() < deadline + 30, jobs.get(store, "poison").state
            time.sleep(0.1)
        kinds = [e["kind"] for e in events.read(store, "poison", limit=100)]
        assert "quarantined" in kinds and kinds.index("resumed") > kinds.index("quarantined")
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=20)


@pytest.mark.slow
def test_leaders_that_stop_cleanly_hand_the_job_over_without_a_strike(etcd: EtcdServer) -> None:
    """Leaders that stop cleanly (rrl down, SIGTERM) hand the job over without a strike."""
    store = etcd.store()
    job_id, spec_json, desired = _validate_spec({"name": "calm2", "model": {"init": {}}, "steps": 5})
    jobs.submit(store, job_id, spec_json, desired)
    for cid in ("calm-a", "calm-b", "calm-c"):
        c = Controller(etcd.store(), cid, ttl=2, driver_factory=IdleDriver, interval=0.2)
        t = threading.Thread(target=c.run, daemon=True)
        t.start()
        deadline = time.monotonic() + 30
        while (jobs.get(store, "calm2").state.get("runner") or {}).get("by") != cid:
            assert time.monotonic() < deadline, jobs.get(store, "calm2").state
            time.sleep(0.05)
        c.stop()
        t.join(timeout=10)
        st = jobs.get(store, "calm2").state
        assert st.get("runner") is None and st.get("runner_strikes", 0) == 0 and st["phase"] == "RUNNING", st


def test_members_reads_the_changes_since_its_last_read_and_finds_the_keys_that_went(etcd: EtcdServer) -> None:
    """Controller.members (the runner's once-a-second reads) reads a delta of its last read:
    it must still equal a full read after puts, deletions, a key that went and came back,
    and other groups' writes."""
    import json

    from controller import keys

    store = etcd.store()
    c = Controller(store, "members-test")

    def put(g: str, w: str, **v: object) -> None:
        store.put(keys.member("job-m", g, w), json.dumps(v))

    def full(g: str) -> dict[str, dict]:
        prefix = keys.members("job-m", g)
        return {kv.key[len(prefix) :]: json.loads(kv.value) for kv in store.range(prefix)[0]}

    for w in range(5):
        put("rollout", str(w), status="idle", step=0)
    put("trainer", "0", status="ready")
    assert c.members("job-m", "rollout") == full("rollout") and len(full("rollout")) == 5
    assert c.members("job-m", "rollout") == full("rollout")  # nothing changed: one range, nothing in it
    put("rollout", "1", status="busy", step=1)  # a change
    put("trainer", "0", status="busy")  # another group's: not this group's business
    assert c.members("job-m", "rollout")["1"] == {"status": "busy", "step": 1}
    store.delete(keys.member("job-m", "rollout", "2"))  # a key that went
    put("rollout", "5", status="idle", step=0)  # and one that came, in the same interval
    assert c.members("job-m", "rollout") == full("rollout") and "2" not in full("rollout")
    store.delete(keys.member("job-m", "rollout", "3"))
    put("rollout", "3", status="starting")  # gone and back between two reads
    store.delete(keys.member("job-m", "rollout", "4"))
    got = c.members("job-m", "rollout")
    assert got == full("rollout") and got["3"] == {"status": "starting"} and "4" not in got
    got["0"] = {"mutated": True}  # the caller's copy of the mapping: the next read is not affected
    assert c.members("job-m", "rollout") == full("rollout")
    assert c.members("job-m", "trainer") == {"0": {"status": "busy"}}
