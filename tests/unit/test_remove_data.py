"""`rrl delete` removes what rrl wrote in a job's folder and nothing of the user's."""

from __future__ import annotations

from pathlib import Path

from controller.jobs import JobRecord
from resilient_rl.cli import _remove_data


def _rec(work: Path) -> JobRecord:
    return JobRecord("gone", {"name": "gone", "model": {"init": {}}, "checkpoint": {"dir": str(work)}}, {}, {})


def test_only_rrls_own_files_are_removed(tmp_path: Path) -> None:
    work = tmp_path / "mine"
    (work / "journal" / "step-00000000").mkdir(parents=True)
    (work / "snapshots" / "step-0000000004").mkdir(parents=True)
    (work / "model").mkdir()
    (work / "model" / "rrl_model_init.json").write_text("{}")
    (work / "metrics.jsonl").write_text("{}\n")
    (work / "notes.txt").write_text("the user's")
    removed = _remove_data(_rec(work))
    assert sorted(Path(p).name for p in removed) == ["journal", "metrics.jsonl", "model", "snapshots"]
    assert (work / "notes.txt").read_text() == "the user's" and work.is_dir()


def test_a_folder_rrl_did_not_fill_is_left_and_an_emptied_one_removed(tmp_path: Path) -> None:
    work = tmp_path / "shared"
    (work / "journal").mkdir(parents=True)
    (work / "journal" / "README").write_text("not a journal")
    (work / "model").mkdir()  # a model of the user's (no rrl marker)
    assert _remove_data(_rec(work)) == []
    assert (work / "journal" / "README").exists() and (work / "model").is_dir()
    only = tmp_path / "only"
    (only / "journal" / "step-00000001").mkdir(parents=True)
    assert str(only) in _remove_data(_rec(only)) and not only.exists()
