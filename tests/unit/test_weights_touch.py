"""How much of the object store the weight store touches at its warm-up (workers/weights.py)."""

from __future__ import annotations

import pytest

from resilient_rl.job.groups import weight_bytes
from resilient_rl.workers.weights import TOUCH_CHUNK, TOUCH_SHARE, WeightStore, touch_chunks


def test_the_touch_covers_the_bytes_asked_in_whole_chunks() -> None:
    assert touch_chunks(3 * TOUCH_CHUNK, 1e12) == 3
    assert touch_chunks(3 * TOUCH_CHUNK + 1, 1e12) == 3  # whole chunks only: never past what was asked
    assert touch_chunks(TOUCH_CHUNK - 1, 1e12) == 0
    assert touch_chunks(0, 1e12) == 0 and touch_chunks(-5, 1e12) == 0


def test_the_touch_never_takes_more_than_its_share_of_the_object_store() -> None:
    capacity = 20 * TOUCH_CHUNK
    assert touch_chunks(1 << 50, capacity) == int(capacity * TOUCH_SHARE) // TOUCH_CHUNK == 10
    assert touch_chunks(1 << 50, 0.0) == 0  # no object store reported: nothing touched


def test_without_ray_the_store_warms_without_touching(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's unit tests run the store in-process, where no object store exists (the
    suite's process may be connected to a platform's Ray by then: not connected here)."""
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "put", lambda *a, **k: pytest.fail("put without Ray"))
    assert WeightStore().warm(1 << 30) == 0


def test_one_version_is_about_the_model_folders_weight_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "pytorch_model-00001.bin").write_bytes(b"x" * 24)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "sub.safetensors").mkdir()  # not a file: left out
    assert weight_bytes(str(tmp_path)) == 1024
    assert weight_bytes(str(tmp_path / "missing")) == 0
