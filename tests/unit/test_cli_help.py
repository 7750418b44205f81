"""`rrl --help`'s command lists: one line of help a command, its docstring's first paragraph."""

from __future__ import annotations

from typer.testing import CliRunner

from resilient_rl.cli import app


def _listing(*args: str) -> str:
    r = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "400"}, terminal_width=400)
    assert r.exit_code == 0, r.output
    return r.output


def test_each_command_of_a_list_reads_as_one_line_not_cut_where_its_docstring_breaks() -> None:
    top = _listing()
    # a docstring broken after "or lift" used to end the list's line there
    assert "also resumes by itself), or lift the quarantine of a QUARANTINED one" in top, top
    assert "serving the HTTP API, the status page and /metrics." in top, top
    for line in top.splitlines():
        if line.startswith("│ resume ") or line.startswith("│ verify "):
            assert line.rstrip(" │").endswith((")", ".")), line  # the whole paragraph, no cut
    sub = _listing("chaos")
    assert "Run one scenario: start a platform, run the job under the fault schedule, check, report." in sub, sub
