"""`connect_ray` tries again when connecting to an overloaded cluster times out, whatever the
case of Ray's words (a CI run's `rrl verify` failed on "Timed out waiting for file
.../gcs_server_port_..." because only "timed out" was recognised). Ray's ``init`` is replaced
here (the outer edge: no cluster is started); the retry logic under test is the product's."""

from __future__ import annotations

from typing import Any

import pytest
import ray

from resilient_rl.job import actors


@pytest.mark.parametrize(
    "words",
    ["Timed out waiting for file /tmp/ray/session_x/gcs_server_port_abc", "The current node timed out during startup"],
)
def test_a_connect_that_times_out_is_tried_again(monkeypatch: pytest.MonkeyPatch, words: str) -> None:
    calls: list[dict[str, Any]] = []
    up = {"now": False}

    def init(**kw: Any) -> None:
        calls.append(kw)
        if len(calls) == 1:
            raise RuntimeError(words)
        up["now"] = True

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: up["now"])
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(actors.time, "sleep", lambda s: None)
    actors.connect_ray("127.0.0.1:6379")
    assert len(calls) == 2 and up["now"] and calls[1]["address"] == "127.0.0.1:6379"


def test_another_error_is_raised_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []

    def init(**kw: Any) -> None:
        calls.append(kw)
        raise ConnectionError("no cluster at 127.0.0.1:6379")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(ConnectionError, match="no cluster"):
        actors.connect_ray("127.0.0.1:6379")
    assert len(calls) == 1
