"""`rrl run` / `rrl submit -f` follow a job to its end: a PAUSED job is followed (it resumes by
itself); a QUARANTINED one ends the follow with the reason, exit 1."""

from __future__ import annotations

from typing import Any

import pytest

from resilient_rl import cli


class FakeClient:
    """The API client's read side, answering with one job record after another (the outer edge)."""

    url = None

    def __init__(self, phases: list[tuple[str, str | None]]) -> None:
        self.recs = [{"spec": {"steps": 5}, "phase": p, "state": {"step": 2, "reason": r}} for p, r in phases]

    def get(self, path: str, **params: Any) -> dict[str, Any]:
        return self.recs.pop(0) if len(self.recs) > 1 else self.recs[0]


def test_follow_waits_through_a_pause_and_stops_at_quarantine(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    monkeypatch.setattr(cli.time, "sleep", lambda s: None)
    client = FakeClient([("RUNNING", None), ("RUNNING", None), ("PAUSED", "journal disk full at /j, 0.0 MB free"),
                         ("PAUSED", "journal disk full at /j, 0.0 MB free"), ("QUARANTINED", "quarantined: x")])  # fmt: skip
    assert cli._follow(client, "j") == 1
    assert len(client.recs) == 1  # followed through both PAUSED reads to the quarantine
    out = capsys.readouterr().out
    assert "j QUARANTINED after 2/5 steps in 0s: quarantined: x" in out


def test_follow_ends_at_success(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli.time, "sleep", lambda s: None)
    assert cli._follow(FakeClient([("RUNNING", None), ("RUNNING", None), ("SUCCEEDED", None)]), "j") == 0


def test_a_long_output_line_stays_one_line_when_piped(capsys: Any) -> None:
    """Piped output (a file, grep) is not wrapped at 80 columns: `rrl verify`'s mismatch naming a
    long journal path once came out as "digest" and "mismatch" on two lines."""
    from resilient_rl.chaos import cli as chaos_cli

    why = "replay failed: JournalCorrupt: shard " + "/deep" * 30 + "/shard-0000.json: digest mismatch (file changed)"
    cli.out.print(f"[red]mismatch[/]: {why}")
    chaos_cli.out.print(why)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"mismatch: {why}", why], lines
