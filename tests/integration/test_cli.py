"""The `rrl` console script, run as a user runs it, against real etcd / Ray / controllers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from resilient_rl.local import Platform, pid_alive, session_pids
from tests.conftest import REPO, EtcdServer, run_rrl

GOOD = (REPO / "examples" / "copy-tiny.yaml").read_text()


def test_submit_malformed_spec_exits_2_naming_field(tmp_path: Path, etcd: EtcdServer) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD.replace("replicas: 1", "replicas: 0").replace("lr: 0.001", "lr: fast"))
    r = run_rrl("submit", str(bad), "--etcd", etcd.endpoint)
    assert r.returncode == 2, r.stderr
    assert str(bad) in r.stderr
    assert "rollout.replicas" in r.stderr and "trainer.lr" in r.stderr
    unknown = tmp_path / "typo.yaml"
    unknown.write_text(GOOD + "\nstepz: 5\n")
    r = run_rrl("submit", str(unknown), "--etcd", etcd.endpoint)
    assert r.returncode == 2 and "stepz" in r.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: x\nmodel: [unclosed\n")
    r = run_rrl("submit", str(broken), "--etcd", etcd.endpoint)
    assert r.returncode == 2 and f"{broken}:" in r.stderr and "YAML" in r.stderr
    r = run_rrl("submit", str(tmp_path / "missing.yaml"), "--etcd", etcd.endpoint)
    assert r.returncode == 2 and "missing.yaml" in r.stderr
    binary = tmp_path / "model.safetensors"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\x00" * 10)
    r = run_rrl("submit", str(binary), "--etcd", etcd.endpoint)
    assert r.returncode == 2 and "not a text job file" in r.stderr and "Traceback" not in r.stderr, r.stderr
    dup = tmp_path / "dup.yaml"
    dup.write_text(GOOD + "\nname: other\n")
    r = run_rrl("submit", str(dup), "--etcd", etcd.endpoint)
    assert r.returncode == 2 and "duplicate key 'name'" in r.stderr and "first given at line" in r.stderr
    huge = tmp_path / "huge.yaml"
    huge.write_text(
        GOOD.replace("steps: 600", "steps: true").replace(
            "prompts_per_step: 16", "prompts_per_step: 99999999999999999999"
        )
    )
    r = run_rrl("submit", str(huge), "--etcd", etcd.endpoint)
    assert r.returncode == 2 and "steps: Input should be a valid integer, not a boolean" in r.stderr, r.stderr
    assert "prompts_per_step: Input should be less than or equal to 65,536" in r.stderr
    # nothing was stored
    assert etcd.store().range("/rrl/v1/jobs/")[0] == []


def test_submit_valid_then_status_and_cancel(etcd: EtcdServer, rrl_home: Path) -> None:
    spec = REPO / "examples" / "copy-tiny.yaml"
    r = run_rrl("submit", str(spec), "--etcd", etcd.endpoint)
    assert r.returncode == 0, r.stderr
    r = run_rrl("submit", str(spec), "--etcd", etcd.endpoint)
    assert r.returncode == 1 and "already exists" in r.stderr
    r = run_rrl("status", "copy-tiny", "--etcd", etcd.endpoint, "-o", "json")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["id"] == "copy-tiny" and rec["phase"] == "PENDING"
    assert rec["spec"]["steps"] == 600 and rec["desired"]["rollout"] == 1 and rec["desired"]["trainer"] == 2
    r = run_rrl("status", "--etcd", etcd.endpoint, env={"COLUMNS": "80"})
    assert "copy-tiny" in r.stdout and "PENDING" in r.stdout
    row = next(line for line in r.stdout.splitlines() if line.startswith("copy-tiny"))
    assert row.split() == ["copy-tiny", "PENDING", "0/600", "0", "-", "rollout", "0/1", "trainer", "0/2"], r.stdout
    r = run_rrl("list", "--etcd", etcd.endpoint, "-o", "json")
    assert json.loads(r.stdout)[0]["id"] == "copy-tiny"
    r = run_rrl("scale", "copy-tiny", "--rollout", "3", "--etcd", etcd.endpoint)
    assert r.returncode == 0 and "copy-tiny: desired now rollout 3, trainer 2" in r.stdout, r.stdout
    r = run_rrl("scale", "copy-tiny", "--trainer", "4", "--expect", "trainer=1", "--etcd", etcd.endpoint)
    assert r.returncode == 1 and "expected trainer=1, but desired trainer is 2; nothing changed" in r.stderr
    r = run_rrl("scale", "copy-tiny", "--trainer", "4", "--expect", "trainers=2", "--etcd", etcd.endpoint)
    assert r.returncode == 2 and "--expect: want GROUP=N" in r.stderr
    r = run_rrl("scale", "copy-tiny", "--trainer", "1", "--expect", "trainer=2", "--etcd", etcd.endpoint)
    assert r.returncode == 0 and "desired now rollout 3, trainer 1" in r.stdout
    r = run_rrl("scale", "copy-tiny", "--trainer", "1025", "--etcd", etcd.endpoint)
    assert r.returncode == 2
    r = run_rrl("cancel", "copy-tiny", "--etcd", etcd.endpoint)
    assert r.returncode == 0
    desired = json.loads(etcd.store().get("/rrl/v1/jobs/copy-tiny/desired").value)  # type: ignore[union-attr]
    assert desired["cancel"] is True and desired["rollout"] == 3 and desired["trainer"] == 1
    r = run_rrl("status", "no-such-job", "--etcd", etcd.endpoint)
    assert r.returncode == 1 and "no job named 'no-such-job'" in r.stderr
    r = run_rrl("status", "Bad/Id", "--etcd", etcd.endpoint)
    assert r.returncode == 1 and "invalid job id" in r.stderr


def test_unreachable_etcd_is_a_clear_error(rrl_home: Path) -> None:
    from resilient_rl.local import free_port

    r = run_rrl("status", "--etcd", f"127.0.0.1:{free_port()}")
    assert r.returncode == 1
    assert "cannot reach etcd" in r.stderr
    r = run_rrl("status")
    assert r.returncode == 1 and "rrl up" in r.stderr


def test_cli_import_is_light() -> None:
    """`rrl --help` must not import torch, Ray or vLLM (it answers in well under a second)."""
    import subprocess
    import sys

    code = (
        "import sys, resilient_rl.cli, controller.service, controller.jobs;"
        "heavy = [m for m in ('torch', 'ray', 'vllm', 'transformers') if m in sys.modules];"
        "print(','.join(heavy))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ""
    r = run_rrl("--help")
    assert r.returncode == 0 and "submit" in r.stdout and "status" in r.stdout


def _platform_pids(home: Path) -> list[int]:
    data = json.loads((home / "platform.json").read_text())
    return [p["pid"] for p in data["processes"].values()]


def _home_pids(home: Path) -> list[int]:
    """Every live process whose command line names ``home`` (etcd's data dir) or Ray's temp dir
    for it (outside ``home``: ``Platform.ray_temp_dir``)."""
    names = (str(home), str(Platform(home).ray_temp_dir()))
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if any(n in cmd for n in names) and pid_alive(int(d.name)):
                out.append(int(d.name))
    return out


def test_up_interrupted_while_ray_starts_leaves_only_what_down_stops(rrl_home: Path) -> None:
    """SIGTERM (or Ctrl-C) to `rrl up` while the Ray head starts: that Ray head is stopped, the
    etcd already up is recorded (it used to be left running with no record: `rrl down` said
    "nothing was running", and the next `rrl up` started a second etcd on the same data dir),
    the next `rrl up` takes it over, and `rrl down` leaves nothing."""
    p = subprocess.Popen([str(Path(sys.executable).parent / "rrl"), "up"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "200"})  # fmt: skip
    try:
        lines = []
        for line in p.stdout or []:
            lines.append(line)
            if line.startswith("starting Ray head"):
                p.send_signal(signal.SIGTERM)  # Ray's head takes seconds to open its port
                break
        out = "".join(lines) + (p.stdout.read() if p.stdout else "")
        assert p.wait(timeout=60) == 143, out
    finally:
        p.kill()
    assert "terminated (SIGTERM)" in out and "Traceback" not in out, out
    etcd = Platform(rrl_home).running()
    assert list(etcd) == ["etcd"], etcd
    assert _home_pids(rrl_home) == [etcd["etcd"]["pid"]], "the interrupted Ray head was left running"
    r = run_rrl("up", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "starting etcd" not in r.stdout and _platform_pids(rrl_home)[0] == etcd["etcd"]["pid"]
    assert run_rrl("down", timeout=120).returncode == 0
    deadline = time.monotonic() + 20
    while _home_pids(rrl_home) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _home_pids(rrl_home) == []


def test_up_status_down_twice_leaves_nothing(rrl_home: Path) -> None:
    for round_ in range(2):
        r = run_rrl("up", timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        pids = _platform_pids(rrl_home)
        assert len(pids) == 3  # etcd, ray, controller
        assert all(pid_alive(p) for p in pids)
        again = run_rrl("up")  # idempotent: starts nothing new
        assert again.returncode == 0 and _platform_pids(rrl_home) == pids
        deadline = time.monotonic() + 30
        while True:
            r = run_rrl("status")
            assert r.returncode == 0, r.stderr
            if "leader" in r.stdout and "no leader" not in r.stdout:
                break
            assert time.monotonic() < deadline, r.stdout
            time.sleep(0.5)
        if round_ == 0:
            assert run_rrl("submit", str(REPO / "examples" / "copy-tiny.yaml")).returncode == 0
        else:
            # etcd kept its data dir: the job submitted in round one is still there
            assert "copy-tiny" in r.stdout
        r = run_rrl("down", timeout=120)
        assert r.returncode == 0, r.stderr
        for pid in pids:
            assert not pid_alive(pid) and session_pids(pid) == [], f"process {pid} survived rrl down"
        assert Platform(rrl_home).running() == {}
