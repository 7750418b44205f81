"""Path safety: no job id, checkpoint folder, step number or shard id can make a job
write outside its own folder. (The API's 422 for hostile ids is in
tests/integration/test_fuzz_api.py.)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from checkpoints.journal import Journal
from checkpoints.snapshots import snapshot_dir
from controller import keys
from controller.keys import InvalidId, check_job_id, check_name
from resilient_rl.spec import SpecError, load_spec, parse_spec

HOSTILE_IDS = ["../x", "a/b", "..", ".", "x\x00", "x" * 64, "Upper", "-x", "x-", "", " x", "x\n", "a\\b", "é", "a.b"]


@pytest.mark.parametrize("bad", HOSTILE_IDS)
def test_hostile_job_ids_are_refused_everywhere(bad: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidId, match="invalid job id"):
        check_job_id(bad)
    for build in (keys.job, keys.spec, keys.state, keys.checkpoints, keys.events):
        with pytest.raises(InvalidId):
            build(bad)
    with pytest.raises(SpecError) as ei:
        parse_spec({"name": bad, "model": {"init": {}}}, "job.yaml")
    assert "  name: " in str(ei.value) and "invalid job id" in str(ei.value)
    f = tmp_path / "job.yaml"
    f.write_text(f"name: {bad!r}\nmodel: {{init: {{}}}}\n".replace("\x00", "\\0"))
    with pytest.raises(SpecError, match="name"):
        load_spec(f)


def test_good_ids_and_names() -> None:
    assert check_job_id("a") == "a" and check_job_id("x" * 63) and check_job_id("copy-tiny-2")
    for bad in ["..", ".", "a/b", "", "x\x00", "w\n"]:
        with pytest.raises(InvalidId):
            check_name(bad, "worker")
    with pytest.raises(InvalidId):
        keys.member("j", "rollout", "../../leader")
    assert keys.split_member_key(keys.member("j", "rollout", "3")) == ("j", "rollout", "3")


def test_checkpoint_dir_is_absolute_and_normalised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = {"name": "j", "model": {"init": {}}}
    spec = parse_spec({**base, "checkpoint": {"dir": "/data/jobs/j/../j/./ck//"}})
    assert spec.checkpoint.dir == "/data/jobs/j/ck"
    home = str(Path("~").expanduser())
    assert parse_spec({**base, "checkpoint": {"dir": "~/ck"}}).checkpoint.dir == os.path.join(home, "ck")
    # through the API (no file, no working folder of the user's): a relative folder is refused, named
    for bad in ["ck", "../ck", "", "  ", "/a\x00b"]:
        with pytest.raises(SpecError) as ei:
            parse_spec({**base, "checkpoint": {"dir": bad}}, "api")
        assert "  checkpoint.dir: " in str(ei.value), str(ei.value)
    # from a job file, a relative folder means "under the folder rrl runs in"
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "job.yaml"
    f.write_text("name: j\nmodel: {init: {}}\ncheckpoint: {dir: runs/../ck}\n")
    assert load_spec(f).checkpoint.dir == str(tmp_path / "ck")


def test_default_workdir_is_inside_rrl_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from resilient_rl.naming import job_workdir

    monkeypatch.setenv("RRL_HOME", str(tmp_path))
    spec = parse_spec({"name": "j-1", "model": {"init": {}}})
    assert job_workdir(spec) == tmp_path / "jobs" / "j-1"


def _inside(path: Path, root: Path) -> bool:
    return path.resolve().is_relative_to(root.resolve())


@pytest.mark.parametrize("step", [0, 7, -1, -(10**12), 10**20, True])
@pytest.mark.parametrize("shard", [0, 3, -5, 10**9])
def test_journal_and_snapshot_paths_stay_in_the_job_folder(tmp_path: Path, step: int, shard: int) -> None:
    root = tmp_path / "job"
    j = Journal(root)
    ref = j.write_shard(step, shard, [{"x": 1}], {})
    assert _inside(Path(ref.path), root) and Path(ref.path).parent == j.step_dir(step)
    assert {p for p in tmp_path.rglob("*") if p.is_file()} <= {p for p in root.rglob("*")}
    if step >= 0:
        assert _inside(snapshot_dir(root, step), root)
    else:
        with pytest.raises(ValueError):
            snapshot_dir(root, step)


@pytest.mark.parametrize("bad", ["../../x", "1/../../x", 1.5, None, b"1"])
def test_non_integer_steps_and_shards_are_refused(tmp_path: Path, bad: object) -> None:
    root = tmp_path / "job"
    j = Journal(root)
    with pytest.raises((ValueError, TypeError)):
        j.write_shard(bad, 0, [], {})  # type: ignore[arg-type]
    with pytest.raises((ValueError, TypeError)):
        j.write_shard(0, bad, [], {})  # type: ignore[arg-type]
    with pytest.raises((ValueError, TypeError)):
        snapshot_dir(root, bad)  # type: ignore[arg-type]
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]
