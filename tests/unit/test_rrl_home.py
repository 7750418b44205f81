"""An RRL_HOME that cannot be the platform's folder: exit 2 naming it, nothing started."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO, run_rrl


@pytest.mark.parametrize("command", [["up"], ["down"], ["run", str(REPO / "examples" / "copy-tiny.yaml")]])
@pytest.mark.parametrize("below", [False, True], ids=["is_a_file", "under_a_file"])
def test_an_rrl_home_that_is_or_is_under_a_file_exits_2_naming_it(
    tmp_path: Path, command: list[str], below: bool
) -> None:
    a_file = tmp_path / "home"
    a_file.write_text("not a folder")
    home = a_file / "deeper" if below else a_file
    r = run_rrl(*command, env={"RRL_HOME": str(home)})
    assert r.returncode == 2 and f"RRL_HOME {home}: {a_file} is not a folder" in r.stderr, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and a_file.read_text() == "not a folder"
