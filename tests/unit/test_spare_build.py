"""A warm spare's build runs in a thread of its own at the lowest CPU priority (trainer.py)."""

from __future__ import annotations

import os
import threading

import pytest

from resilient_rl.workers.trainer import _in_background_thread


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_the_build_runs_at_nice_19_and_leaves_the_caller_s_priority_alone() -> None:
    before = _nice()
    seen = _in_background_thread(lambda: (threading.current_thread().name, _nice()))
    assert seen == ("spare-build", 19)
    assert _nice() == before  # only the build's own thread was lowered


def test_an_error_of_the_build_is_raised_in_the_caller() -> None:
    def broken() -> None:
        raise FileNotFoundError("model.safetensors")

    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        _in_background_thread(broken)
