"""The controller HTTP API against a real etcd, served by real controllers (leader + standby).

The controllers run in this process (``Controller`` + ``HttpServer``, as `rrl controller`
wires them) without a job driver, so a submitted job stays PENDING instead of starting
Ray; one test starts a real `rrl controller` process to check the wiring itself.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controller import jobs, keys, service
from controller.http.api import create_app
from controller.http.server import HttpServer
from controller.membership import Registration
from controller.service import Controller
from resilient_rl.cli import _validate_spec
from resilient_rl.local import ManagedProcess, ensure_token
from tests.conftest import REPO, EtcdServer, run_rrl

TOKEN = "test-token-123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def spec(name: str, **over: Any) -> dict[str, Any]:
    s: dict[str, Any] = {
        "name": name,
        "model": {"init": {}},
        "task": {"kind": "copy", "num_prompts": 64},
        "rollout": {"replicas": 1, "engine": "hf"},
        "trainer": {"replicas": 1},
        "steps": 5,
    }
    s.update(over)
    return s


class Ctl:
    """One controller (election + registration + reconcile) serving the API, like `rrl controller`."""

    def __init__(self, etcd: EtcdServer, cid: str, allow_kill: bool = True) -> None:
        self.store = etcd.store()
        app = create_app(self.store, token=TOKEN, served_by=cid, validate_spec=_validate_spec, stream_interval=0.2,
                         allow_kill=allow_kill, leadership=lambda: self.c.token if self.c.leads else 0)  # fmt: skip
        self.http = HttpServer(app).start()
        self.url = self.http.url
        self.c = Controller(self.store, cid, ttl=2, info={"http": self.url}, interval=0.2)
        self.thread = threading.Thread(target=self.c.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.c.stop()
        self.thread.join(timeout=10)
        self.http.stop()


@pytest.fixture
def ctls(etcd: EtcdServer) -> Iterator[tuple[Ctl, Ctl]]:
    """(leader, standby), both registered with their HTTP address."""
    a = Ctl(etcd, "ctl-a")
    deadline = time.monotonic() + 10
    while not a.c.election.is_leader:
        assert time.monotonic() < deadline, "ctl-a did not lead"
        time.sleep(0.05)
    b = Ctl(etcd, "ctl-b")
    store = etcd.store()
    while len([c for c in service.controllers(store) if c.get("http")]) < 2:
        assert time.monotonic() < deadline, service.controllers(store)
        time.sleep(0.05)
    try:
        yield a, b
    finally:
        b.stop()
        a.stop()


def desired(etcd: EtcdServer, job: str) -> dict[str, Any]:
    kv = etcd.store().get(keys.desired(job))
    assert kv is not None
    return dict(json.loads(kv.value))


def test_mutations_need_the_token_reads_do_not(ctls: tuple[Ctl, Ctl], etcd: EtcdServer) -> None:
    leader, _ = ctls
    u = leader.url + "/api/v1"
    r = httpx.post(f"{u}/jobs", json={"spec": spec("tok")})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert jobs.list_ids(etcd.store()) == []  # nothing was written
    r = httpx.post(f"{u}/jobs", json={"spec": spec("tok")}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = httpx.post(f"{u}/jobs", json={"spec": spec("tok")}, headers=AUTH)
    assert r.status_code == 201, r.text
    assert r.json() == {"id": "tok", "desired": {"rollout": 1, "trainer": 1}}
    for path, body in (("scale", {"rollout": 3}), ("cancel", None), ("workers/rollout/0/kill", None)):
        assert httpx.post(f"{u}/jobs/tok/{path}", json=body).status_code == 401, path
    d = desired(etcd, "tok")
    assert d["rollout"] == 1 and "cancel" not in d
    # reads are open
    assert httpx.get(f"{u}/jobs/tok").json()["spec"]["steps"] == 5
    assert httpx.get(f"{u}/jobs").json()["jobs"][0]["id"] == "tok"


def test_bad_payloads_are_422_naming_the_field(ctls: tuple[Ctl, Ctl], etcd: EtcdServer) -> None:
    leader, _ = ctls
    u = leader.url + "/api/v1"
    assert httpx.post(f"{u}/jobs", json={"spec": spec("bad")}, headers=AUTH).status_code == 201

    def fields(r: httpx.Response) -> set[str]:
        assert r.status_code == 422, r.text
        return {str(d["loc"][-1]) for d in r.json()["detail"]} | {d.get("field", "") for d in r.json()["detail"]}

    assert "rollout" in fields(httpx.post(f"{u}/jobs/bad/scale", json={"rollout": 0}, headers=AUTH))
    assert "trainer" in fields(httpx.post(f"{u}/jobs/bad/scale", json={"trainer": "two"}, headers=AUTH))
    assert "rolout" in fields(httpx.post(f"{u}/jobs/bad/scale", json={"rolout": 2}, headers=AUTH))
    r = httpx.post(f"{u}/jobs/bad/scale", json={}, headers=AUTH)
    assert r.status_code == 422 and "rollout, trainer and/or strategy" in r.text
    assert "strategy" in fields(httpx.post(f"{u}/jobs/bad/scale", json={"strategy": "zero3"}, headers=AUTH))
    assert desired(etcd, "bad")["rollout"] == 1
    # a spec is checked against the job schema; each bad field is named by its path
    bad = spec("bad2", rollout={"replicas": 0}, trainer={"lr": "fast"})
    got = fields(httpx.post(f"{u}/jobs", json={"spec": bad}, headers=AUTH))
    assert {"rollout.replicas", "trainer.lr"} <= got
    assert "stepz" in fields(httpx.post(f"{u}/jobs", json={"spec": {**spec("bad3"), "stepz": 1}}, headers=AUTH))
    assert "spec" in fields(httpx.post(f"{u}/jobs", json={"specs": {}}, headers=AUTH))
    assert jobs.list_ids(etcd.store()) == ["bad"]
    assert "limit" in fields(httpx.get(f"{u}/jobs/bad/events", params={"limit": 0}))
    r = httpx.get(f"{u}/jobs/Bad_Id")
    assert r.status_code == 422 and "invalid job id" in r.text
    # a taken id is a conflict, not a validation error
    assert httpx.post(f"{u}/jobs", json={"spec": spec("bad")}, headers=AUTH).status_code == 409


def test_racing_scales_with_expect_one_wins_the_rest_are_told_the_current_size(
    ctls: tuple[Ctl, Ctl], etcd: EtcdServer
) -> None:
    leader, standby = ctls
    assert httpx.post(f"{leader.url}/api/v1/jobs", json={"spec": spec("race")}, headers=AUTH).status_code == 201
    results: list[httpx.Response] = []
    lock = threading.Lock()

    def scale(n: int, via: Ctl) -> None:
        r = httpx.post(f"{via.url}/api/v1/jobs/race/scale", json={"rollout": n, "expect": {"rollout": 1}},
                       headers=AUTH, timeout=30)  # fmt: skip
        with lock:
            results.append(r)

    threads = [threading.Thread(target=scale, args=(n, (leader, standby)[n % 2])) for n in range(2, 10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [r for r in results if r.status_code == 200]
    assert len(won) == 1, [(r.status_code, r.text) for r in results]
    n = won[0].json()["written"]["rollout"]
    assert desired(etcd, "race")["rollout"] == n and won[0].json()["desired"]["rollout"] == n
    for r in results:
        if r.status_code != 200:
            assert r.status_code == 409, r.text
            assert r.json()["detail"] == f"race: expected rollout=1, but desired rollout is {n}; nothing changed"
    # without expect the last writer wins, and the reply says what holds after the write
    r = httpx.post(f"{leader.url}/api/v1/jobs/race/scale", json={"trainer": 2}, headers=AUTH)
    assert r.json()["desired"] == {**desired(etcd, "race")} and r.json()["desired"]["trainer"] == 2
    bad = httpx.post(
        f"{leader.url}/api/v1/jobs/race/scale", json={"trainer": 2, "expect": {"weights": 1}}, headers=AUTH
    )
    assert bad.status_code == 422


def test_delete_frees_a_finished_jobs_name_and_refuses_a_live_one(ctls: tuple[Ctl, Ctl], etcd: EtcdServer) -> None:
    leader, _ = ctls
    u = leader.url + "/api/v1/jobs"
    assert httpx.post(u, json={"spec": spec("again")}, headers=AUTH).status_code == 201
    r = httpx.post(u, json={"spec": spec("again")}, headers=AUTH)
    assert r.status_code == 409 and "`rrl delete again` once it has ended" in r.json()["detail"]
    deadline = time.monotonic() + 10
    while jobs.get(etcd.store(), "again").phase != "PENDING" or not jobs.get(etcd.store(), "again").state:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = httpx.delete(f"{u}/again", headers=AUTH)
    assert r.status_code == 409 and "is PENDING: `rrl cancel again` it first" in r.json()["detail"]
    assert httpx.delete(f"{u}/again").status_code == 401  # a mutation: the token is needed
    assert httpx.post(f"{u}/again/cancel", headers=AUTH).status_code == 200
    while jobs.get(etcd.store(), "again").phase != "CANCELLED":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = httpx.post(f"{u}/again/resume", headers=AUTH)
    assert r.status_code == 409 and "only a PAUSED or QUARANTINED job can be resumed" in r.json()["detail"]
    r = httpx.delete(f"{u}/again", headers=AUTH)
    assert r.status_code == 200, r.text
    assert etcd.store().range(keys.job("again"))[0] == []  # spec, desired, state, events: all gone
    assert httpx.post(u, json={"spec": spec("again")}, headers=AUTH).status_code == 201  # the name is free
    while not jobs.get(etcd.store(), "again").state:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    evs = httpx.get(f"{u}/again/events").json()
    assert (evs["events"][0]["seq"], evs["events"][0]["kind"]) == (0, "submitted"), evs  # a log of its own
    assert httpx.delete(f"{u}/nope", headers=AUTH).status_code == 404


def test_unknown_job_is_404_and_writes_nothing(ctls: tuple[Ctl, Ctl], etcd: EtcdServer) -> None:
    leader, _ = ctls
    u = leader.url + "/api/v1/jobs/nope"
    for path in ("", "/view", "/events", "/members", "/checkpoints", "/stream"):
        r = httpx.get(u + path)
        assert r.status_code == 404 and r.json()["detail"] == "no job named 'nope'", path
    for path, body in (("/scale", {"rollout": 2}), ("/cancel", None), ("/workers/rollout/0/kill", None)):
        assert httpx.post(u + path, json=body, headers=AUTH).status_code == 404, path
    assert httpx.get(leader.url + "/jobs/nope").status_code == 404  # the page too
    assert etcd.store().range(keys.job("nope"))[0] == []


def test_scale_and_cancel_through_the_standby_take_effect(ctls: tuple[Ctl, Ctl], etcd: EtcdServer) -> None:
    leader, standby = ctls
    assert standby.c.election.is_leader is False
    ctrls = httpx.get(standby.url + "/api/v1/controllers").json()
    assert [(c["id"], c["leader"], c["http"]) for c in ctrls] == [
        ("ctl-a", True, leader.url),
        ("ctl-b", False, standby.url),
    ]
    assert httpx.get(standby.url + "/api/v1/leader").json()["id"] == "ctl-a"
    u = standby.url + "/api/v1/jobs"
    assert httpx.post(u, json={"spec": spec("via-standby")}, headers=AUTH).status_code == 201
    r = httpx.post(f"{u}/via-standby/scale", json={"rollout": 3, "trainer": 2}, headers=AUTH)
    assert r.status_code == 200, r.text
    d = desired(etcd, "via-standby")
    assert d["rollout"] == 3 and d["trainer"] == 2
    # the leader reconciles what the standby wrote: the job is picked up, then cancelled
    deadline = time.monotonic() + 10
    while jobs.get(etcd.store(), "via-standby").phase != "PENDING" or not jobs.get(etcd.store(), "via-standby").state:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert httpx.post(f"{u}/via-standby/cancel", headers=AUTH).status_code == 200
    while jobs.get(etcd.store(), "via-standby").phase != "CANCELLED":
        assert time.monotonic() < deadline, jobs.get(etcd.store(), "via-standby").state
        time.sleep(0.05)
    evs = httpx.get(f"{standby.url}/api/v1/jobs/via-standby/events").json()["events"]
    assert [e["kind"] for e in evs] == ["submitted", "cancelled"] and evs[0]["leader"] == "ctl-a"


def test_events_paging_members_checkpoints_openapi(ctls: tuple[Ctl, Ctl], etcd: EtcdServer) -> None:
    leader, _ = ctls
    u = leader.url + "/api/v1"
    assert httpx.post(f"{u}/jobs", json={"spec": spec("paged")}, headers=AUTH).status_code == 201
    deadline = time.monotonic() + 10
    while not httpx.get(f"{u}/jobs/paged/events").json()["events"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for i in range(5):  # more events, as the leader writes them
        leader.c.event("paged", "scale", f"event {i}", worker=i)
    seen, after = [], -1
    while True:
        page = httpx.get(f"{u}/jobs/paged/events", params={"after": after, "limit": 2}).json()
        if not page["events"]:
            break
        assert len(page["events"]) <= 2
        seen += [e["seq"] for e in page["events"]]
        after = page["next_after"]
    assert seen == list(range(6))
    # members come from the membership records, with this host's pid
    reg = Registration(etcd.store(), "paged", "rollout", "0", ttl=3, version=0)
    try:
        rows = httpx.get(f"{u}/jobs/paged/members").json()["rollout"]
        assert rows[0]["id"] == "0" and rows[0]["pid"] == os.getpid() and rows[0]["restarts"] == 0
    finally:
        reg.close()
    assert httpx.get(f"{u}/jobs/paged/checkpoints").json() == []
    schema = httpx.get(leader.url + "/openapi.json").json()
    for path in ("/api/v1/jobs", "/api/v1/jobs/{job}/scale", "/api/v1/jobs/{job}/events", "/api/v1/leader"):
        assert path in schema["paths"], path
    assert httpx.get(leader.url + "/docs").status_code == 404  # no CDN-loaded docs page


def test_kill_worker_by_pid_on_this_host(ctls: tuple[Ctl, Ctl], etcd: EtcdServer) -> None:
    leader, _ = ctls
    u = leader.url + "/api/v1"
    assert httpx.post(f"{u}/jobs", json={"spec": spec("chaos")}, headers=AUTH).status_code == 201
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    reg = Registration(etcd.store(), "chaos", "rollout", "0", ttl=3, pid=victim.pid)
    far = Registration(etcd.store(), "chaos", "rollout", "1", ttl=3, pid=victim.pid, node="another-host")
    try:
        r = httpx.post(f"{u}/jobs/chaos/workers/rollout/1/kill", headers=AUTH)
        assert r.status_code == 409 and "another-host" in r.text
        assert victim.poll() is None
        r = httpx.post(f"{u}/jobs/chaos/workers/rollout/0/kill", headers=AUTH)
        assert r.status_code == 200 and r.json()["pid"] == victim.pid
        assert victim.wait(timeout=10) == -9
        assert httpx.post(f"{u}/jobs/chaos/workers/rollout/7/kill", headers=AUTH).status_code == 404
    finally:
        reg.close()
        far.close()
        if victim.poll() is None:
            victim.kill()


def test_metrics_and_pages_escape_what_etcd_holds(ctls: tuple[Ctl, Ctl], etcd: EtcdServer) -> None:
    leader, _ = ctls
    u = leader.url
    assert httpx.post(f"{u}/api/v1/jobs", json={"spec": spec("esc")}, headers=AUTH).status_code == 201
    deadline = time.monotonic() + 10
    while not jobs.get(etcd.store(), "esc").state:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    evil = "<script>alert('x')</script><b>bold</b>"
    # a fault and its recovery, as the leader's runner writes them
    leader.c.event("esc", "rollout_joined", "rollout worker 1 joined", worker=1)  # a start, not a recovery
    leader.c.event("esc", "rollout_fault", "rollout worker 1 lost", worker=1)
    leader.c.event("esc", "rollout_joined", "rollout worker 1 joined again", worker=1, recovery_s=2.5)
    leader.c.event("esc", "group_restored", "rollout group back", group="rollout", seconds=2.5)
    leader.c.update_state("esc", phase="FAILED", reason=evil, step=2, reward=0.25, step_seconds=0.5)
    leader.c.event("esc", "failed", evil)
    summary = httpx.get(f"{u}/api/v1/jobs/esc").json()["summary"]
    assert (summary["failures"], summary["recoveries"]) == (2, 1)
    view = httpx.get(f"{u}/api/v1/jobs/esc/view").json()
    assert [(m["kind"], m["what"]) for m in view["markers"]] == [
        ("rollout_fault", "fault"),
        ("rollout_joined", "recovery"),
        ("group_restored", "recovery"),
        ("failed", "fault"),
    ]
    assert view["workers"] == {}
    page = httpx.get(f"{u}/jobs/esc").text
    assert evil not in page and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
    assert "<script>alert" not in page.replace('<script id="initial-view"', "").replace("<script src=", "")
    assert "</script><b>" not in page  # the embedded JSON cannot close its script element
    index = httpx.get(u + "/").text
    assert 'href="/jobs/esc"' in index and "FAILED" in index
    text = httpx.get(u + "/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    steps = {s.labels["job"]: s.value for s in fams["rrl_job_committed_steps"].samples if s.name.endswith("_total")}
    assert steps == {"esc": 2.0}
    assert [s.value for s in fams["rrl_job_reward"].samples] == [0.25]
    assert {s.labels["phase"] for s in fams["rrl_job_phase"].samples} == {"FAILED"}
    assert fams["rrl_job_faults"].samples[0].value == 2
    counts = {s.labels["kind"]: s.value for s in fams["rrl_recovery_seconds"].samples if s.name.endswith("_count")}
    assert counts == {"rollout_joined": 1, "group_restored": 1}
    restarts = {s.labels["group"]: s.value for s in fams["rrl_worker_restarts"].samples if s.name.endswith("_total")}
    assert restarts == {"rollout": 1, "trainer": 0}
    assert fams["rrl_etcd_up"].samples[0].value == 1
    assert "rrl_etcd_request_errors" in fams and "rrl_leader_changes" in fams


def test_cli_goes_through_the_api(ctls: tuple[Ctl, Ctl], etcd: EtcdServer, rrl_home: Path) -> None:
    """With controllers registered, `rrl` talks to one over HTTP (so it needs the token)."""
    f = REPO / "examples" / "copy-tiny.yaml"
    env = {"RRL_TOKEN": TOKEN}
    r = run_rrl("submit", str(f), "--name", "by-cli", "--etcd", etcd.endpoint, env={"RRL_TOKEN": "nope"})
    assert r.returncode == 1 and "refused" in r.stderr and "token" in r.stderr
    r = run_rrl("submit", str(f), "--name", "by-cli", "--etcd", etcd.endpoint, env=env)
    assert r.returncode == 0, r.stderr
    r = run_rrl("scale", "by-cli", "--rollout", "4", "--etcd", etcd.endpoint, env=env)
    assert r.returncode == 0, r.stderr
    assert desired(etcd, "by-cli")["rollout"] == 4
    r = run_rrl("status", "by-cli", "-o", "json", "--etcd", etcd.endpoint)
    rec = json.loads(r.stdout)
    assert rec["summary"]["desired"]["rollout"] == 4 and rec["spec"]["steps"] == 600
    r = run_rrl("events", "by-cli", "--etcd", etcd.endpoint)
    assert "submitted" in r.stdout
    r = run_rrl("ui", "--etcd", etcd.endpoint)
    assert r.stdout.strip() == ctls[0].url + "/"


def test_rrl_controller_process_serves_http_with_a_private_token(etcd: EtcdServer, tmp_path: Path) -> None:
    token_file = tmp_path / "home" / "token"
    rrl = Path(sys.executable).parent / "rrl"
    argv = [str(rrl), "controller", "--etcd", etcd.endpoint, "--id", "proc-0", "--token-file", str(token_file)]
    proc = ManagedProcess.spawn("ctl", argv, tmp_path / "ctl.log")
    try:
        store = etcd.store()
        deadline = time.monotonic() + 60
        while not (ctrls := [c for c in service.controllers(store) if c.get("http")]):
            assert proc.alive(), (tmp_path / "ctl.log").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.2)
        url = ctrls[0]["http"]
        assert url.startswith("http://127.0.0.1:")
        assert httpx.get(url + "/healthz").json() == {"ok": True, "served_by": "proc-0"}
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 32 and ensure_token(token_file) == token  # created once, then reused
        r = httpx.post(url + "/api/v1/jobs/x/cancel", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 404  # past the token check
    finally:
        proc.stop()


def test_rrl_events_follow_prints_new_events_as_they_come(
    ctls: tuple[Ctl, Ctl], etcd: EtcdServer, rrl_home: Path
) -> None:
    leader, _ = ctls
    assert httpx.post(leader.url + "/api/v1/jobs", json={"spec": spec("follow")}, headers=AUTH).status_code == 201
    rrl = Path(sys.executable).parent / "rrl"
    argv = [str(rrl), "events", "follow", "--follow", "-o", "json", "--etcd", etcd.endpoint]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        first = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        assert first["kind"] == "submitted" and first["seq"] == 0
        leader.c.event("follow", "scale", "later event")  # written after the CLI printed the log so far
        later = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        assert (later["seq"], later["message"]) == (1, "later event")
        assert proc.poll() is None  # still following
    finally:
        os.killpg(proc.pid, 9)
        proc.wait(timeout=10)


def test_the_kill_route_is_off_unless_the_controller_allows_it(etcd: EtcdServer) -> None:
    off = Ctl(etcd, "ctl-off", allow_kill=False)
    try:
        u = off.url + "/api/v1"
        deadline = time.monotonic() + 10
        while not off.c.election.is_leader:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert httpx.post(f"{u}/jobs", json={"spec": spec("calm")}, headers=AUTH).status_code == 201
        victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        reg = Registration(etcd.store(), "calm", "rollout", "0", ttl=3, pid=victim.pid)
        try:
            r = httpx.post(f"{u}/jobs/calm/workers/rollout/0/kill", headers=AUTH)
            assert r.status_code == 403 and "--allow-kill" in r.text
            assert victim.poll() is None  # untouched
            assert httpx.get(f"{u}/jobs/calm/view").json()["allow_kill"] is False  # the page hides the button
        finally:
            reg.close()
            victim.kill()
            victim.wait()
    finally:
        off.stop()


def test_worker_logs_need_the_token_and_are_merged_paged_and_selected(etcd: EtcdServer, tmp_path: Path) -> None:
    """`GET /jobs/{job}/logs` reads the files the workers capture under <workdir>/logs (here
    written by the test): token required, lines merged in time order, a group or one worker
    selected, pages after a time, bad parameters refused naming them."""
    from starlette.testclient import TestClient

    from resilient_rl.spec import parse_spec

    store = etcd.store()
    s = parse_spec(spec("lg"))
    jobs.submit(store, "lg", s.to_json(), {"rollout": 1, "trainer": 1})
    app = create_app(store, token=TOKEN, served_by="t", validate_spec=_validate_spec,
                     metrics_path=lambda rec: tmp_path / "metrics.jsonl")  # fmt: skip
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rollout-0.11.log").write_text("1.0 r a\n3.0 Traceback (most recent call last):\n5.0 r c\n")
    (logs / "rollout-spare-0.13.log").write_text("2.5 spare\n")
    (logs / "trainer-0.12.log").write_text("2.0 t a\n4.0 t b\n")
    c = TestClient(app)
    u = "/api/v1/jobs/lg/logs"
    assert c.get(u).status_code == 401  # logs can hold secrets: unlike other reads, the token is needed
    r = c.get(u, headers=AUTH).json()
    assert [(x["source"], x["text"]) for x in r["lines"]] == [
        ("rollout-0", "r a"), ("trainer-0", "t a"), ("rollout-spare-0", "spare"),
        ("rollout-0", "Traceback (most recent call last):"), ("trainer-0", "t b"), ("rollout-0", "r c"),
    ]  # fmt: skip
    assert r["next_after"] == 5.0 and {f["name"] for f in r["files"]} == {"rollout-0", "rollout-spare-0", "trainer-0"}
    r = c.get(u, headers=AUTH, params={"group": "trainer"}).json()
    assert [x["text"] for x in r["lines"]] == ["t a", "t b"]
    r = c.get(u, headers=AUTH, params={"group": "rollout", "worker": 0, "limit": 1}).json()
    assert [x["text"] for x in r["lines"]] == ["r c"]  # the tail
    r = c.get(u, headers=AUTH, params={"after": 2.0, "limit": 2}).json()
    assert [x["text"] for x in r["lines"]] == ["spare", "Traceback (most recent call last):"]  # a page
    assert r["next_after"] == 3.0
    assert c.get(u, headers=AUTH, params={"worker": 0}).status_code == 422
    bad = c.get(u, headers=AUTH, params={"group": "bogus"})
    assert bad.status_code == 422 and "group" in bad.text
    assert c.get("/api/v1/jobs/nope/logs", headers=AUTH).status_code == 404
