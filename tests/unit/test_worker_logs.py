"""A worker's captured output (resilient_rl/workers/logcapture.py) and how it is read back
(controller/worker_logs.py): real processes whose fds 1 and 2 are captured, a child process
that inherits them, a raised traceback, rotation, the merge of several workers and `-f`."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

from controller import worker_logs

SCRIPT = textwrap.dedent(
    """
    import os, subprocess, sys, time
    import resilient_rl.workers.logcapture as lc
    lc.MAX_BYTES = int(sys.argv[3])
    lc._in_actor = lambda: True  # as in a Ray actor (this script is a plain process)
    cap = lc.capture(sys.argv[1], sys.argv[2])
    print("hello from python")
    os.write(1, b"straight to fd 1\\n")
    sys.stderr.write("to stderr\\n")
    subprocess.run([sys.executable, "-c", "import sys; print('child says hi', file=sys.stderr)"])
    for i in range(int(sys.argv[4])):
        print(f"line {i:04d} " + "x" * 60)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        import traceback
        traceback.print_exc()
    if len(sys.argv) > 5:
        lc.capture(sys.argv[1], sys.argv[5])  # promoted: later lines under the new name
        print("after promotion")
    time.sleep(0.3)  # the drain thread writes what is in the pipe
    """
)


def _run(workdir: Path, name: str, max_bytes: int = 1 << 20, lines: int = 3, *extra: str) -> None:
    subprocess.run([sys.executable, "-c", SCRIPT, str(workdir), name, str(max_bytes), str(lines), *extra],
                   check=True, timeout=60, capture_output=True)  # fmt: skip


def test_everything_a_worker_process_writes_is_captured_with_its_time(tmp_path: Path) -> None:
    t0 = time.time()
    _run(tmp_path, "rollout-0")
    (f,) = worker_logs.list_files(tmp_path / "logs")
    assert f.name == "rollout-0" and f.paths == (tmp_path / "logs" / f"rollout-0.{f.pid}.log",)
    lines = worker_logs.read([f])
    texts = [x.text for x in lines]
    for want in ("hello from python", "straight to fd 1", "to stderr", "child says hi", "RuntimeError: boom"):
        assert want in texts, texts
    assert "Traceback (most recent call last):" in texts
    assert all(t0 <= x.time <= time.time() for x in lines)
    assert [x.time for x in lines] == sorted(x.time for x in lines)


def test_rotation_keeps_the_newest_files_and_reads_them_in_order(tmp_path: Path) -> None:
    _run(tmp_path, "trainer-1", 4000, 400)  # ~30 KB through 4 KB files
    (f,) = worker_logs.list_files(tmp_path / "logs")
    assert len(f.paths) == 1 + worker_logs.KEEP and f.paths[0].name.endswith(".log.2")
    assert all(p.stat().st_size <= 4000 for p in f.paths)
    numbered = [int(x.text.split()[1]) for x in worker_logs.read([f]) if x.text.startswith("line ")]
    assert numbered == list(range(numbered[0], 400)) and numbered[0] > 0  # the oldest rotated away, no gap


def test_selection_merge_tail_pages_and_a_promoted_spare(tmp_path: Path) -> None:
    _run(tmp_path, "rollout-0")
    _run(tmp_path, "rollout-spare-0", 1 << 20, 3, "rollout-1")
    _run(tmp_path, "trainer-0")
    files = worker_logs.list_files(tmp_path / "logs")
    assert sorted(f.name for f in files) == ["rollout-0", "rollout-1", "rollout-spare-0", "trainer-0"]
    assert [f.name for f in worker_logs.select(files, "trainer")] == ["trainer-0"]
    assert sorted(f.name for f in worker_logs.select(files, "rollout")) == ["rollout-0", "rollout-1", "rollout-spare-0"]
    (one,) = worker_logs.select(files, "rollout", 1)
    assert [x.text for x in worker_logs.read([one])] == ["after promotion"]
    merged = worker_logs.read(files)
    assert [x.time for x in merged] == sorted(x.time for x in merged)
    assert {x.source for x in merged} == {"rollout-0", "rollout-1", "rollout-spare-0", "trainer-0"}
    tail = worker_logs.read(files, limit=3)
    assert tail == merged[-3:]
    page = worker_logs.read(files, after=merged[4].time, limit=5)
    assert page == merged[5:10]


def test_the_follower_sees_new_lines_new_files_and_rotations(tmp_path: Path) -> None:
    folder = tmp_path / "logs"
    folder.mkdir()
    live = folder / "rollout-0.7.log"
    live.write_text("1.0 old line\n")
    follow = worker_logs.Follower(folder, "rollout", None, after=1.5)
    assert follow.poll() == []  # older than `after`
    with live.open("a") as f:
        f.write("2.0 first\n3.0 part")  # a line still being written is not read yet
    assert [x.text for x in follow.poll()] == ["first"]
    with live.open("a") as f:
        f.write("ial\n")
    assert [x.text for x in follow.poll()] == ["partial"]
    with live.open("a") as f:
        f.write("4.0 before rotation\n")
    live.rename(folder / "rollout-0.7.log.1")  # rotated: the rest of the old file is read from .1
    live.write_text("5.0 after rotation\n")
    (folder / "rollout-1.8.log").write_text("4.5 a new worker\n")
    assert [x.text for x in follow.poll()] == ["before rotation", "a new worker", "after rotation"]
    assert follow.poll() == []


def test_no_capture_outside_a_ray_actor(tmp_path: Path) -> None:
    """A worker class built in a plain process (a test, a tool) leaves its stdout and stderr alone."""
    from resilient_rl.workers import logcapture

    assert logcapture.capture(tmp_path, "trainer-0") is None
    assert not (tmp_path / "logs").exists()
