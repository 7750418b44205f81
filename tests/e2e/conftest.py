"""A real local platform (etcd + Ray head + leader controller, as `rrl up` starts it)
shared by the end-to-end tests of this folder, torn down by PID afterwards."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controller import jobs
from controller.store import Store
from resilient_rl.local import Platform
from resilient_rl.spec import parse_spec


class LivePlatform:
    def __init__(self, home: Path) -> None:
        self.home = home
        self.platform = Platform(home)
        self.data = self.platform.up(progress=lambda *_: None, allow_kill=True)  # the page's kill button
        self.store = Store(self.data["etcd"])

    def submit(self, spec_dict: dict[str, Any]) -> str:
        spec = parse_spec(spec_dict)
        jobs.submit(
            self.store, spec.name, spec.to_json(), {"rollout": spec.rollout.replicas, "trainer": spec.trainer.replicas}
        )
        return spec.name

    def wait(self, job: str, timeout: float = 600) -> jobs.JobRecord:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rec = jobs.get(self.store, job)
            if rec.phase in jobs.TERMINAL:
                return rec
            time.sleep(0.5)
        log = (self.home / "logs" / "controller-0.log").read_text()[-3000:]
        raise AssertionError(f"job {job} did not finish in {timeout}s; controller log tail:\n{log}")

    def ray(self) -> Any:
        import ray

        if not ray.is_initialized():
            ray.init(address=self.data["ray"], namespace="rrl-tests", log_to_driver=False)
        return ray

    def close(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        self.store.close()
        self.platform.down(progress=lambda *_: None)


@pytest.fixture(scope="session")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LivePlatform]:
    home = tmp_path_factory.mktemp("rrl-home")
    old = os.environ.get("RRL_HOME")
    os.environ["RRL_HOME"] = str(home)
    p = LivePlatform(home)
    try:
        yield p
    finally:
        p.close()
        if old is None:
            os.environ.pop("RRL_HOME", None)
        else:
            os.environ["RRL_HOME"] = old


def journal_samples(workdir: Path, step: int) -> list[dict[str, Any]]:
    from checkpoints.journal import Journal

    return Journal(workdir / "journal").read_batch(step)


def metrics(workdir: Path) -> list[dict[str, Any]]:
    from controller import steplog

    return steplog.read(workdir / "metrics.jsonl")
