"""`rrl init-model` on bad input: exit 2 and a message that names the option or the folder,
never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from resilient_rl.cli import app


def _run(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["init-model", *args], terminal_width=400)
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception  # no traceback
    return r.exit_code, r.output


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--num-heads", "0"], "--num-heads: Input should be greater than or equal to 1"),
        (["--num-layers", "1000"], "--num-layers: Input should be less than or equal to 48"),
        (["--num-kv-heads", "3"], "num_heads must be a multiple of num_kv_heads"),  # a check across options
    ],
)
def test_a_bad_size_exits_2_naming_its_option(tmp_path: Path, args: list[str], named: str) -> None:
    code, text = _run(str(tmp_path / "m"), *args)
    assert code == 2 and named in text, text
    assert not (tmp_path / "m").exists()


def test_a_folder_that_cannot_take_the_model_exits_2_naming_it(tmp_path: Path) -> None:
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    code, text = _run(str(a_file))
    assert code == 2 and f"{a_file}: exists and is not a folder" in text, text
    code, text = _run(str(a_file / "sub"))  # a path through a file
    assert code == 2 and f"{a_file / 'sub'}: cannot write the model:" in text, text
    assert a_file.read_text() == "x"
