"""Run a function on ``world`` local processes joined in one gloo process group (no Ray).

What the trainer's core needs to run sharded without the job around it: the tests of its
arithmetic (DDP and FSDP2 over gloo on the CPU) and ``python -m bench sharded``. Each rank
runs ``fn(rank, world, *args)`` in a spawned process (``fn`` importable by name); rank
results come back in rank order, and a rank that raised or died fails the call with its
traceback. The processes are the caller's children, killed by handle on timeout.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from resilient_rl.local import free_port
from resilient_rl.naming import TRAINER_ENV


def _entry(rank: int, world: int, port: int, out: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    result: dict[str, Any]
    try:
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
        try:
            result = {"ok": fn(rank, world, *args)}
        finally:
            dist.destroy_process_group()
    except BaseException:
        result = {"error": traceback.format_exc()}
    with open(os.path.join(out, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


@contextlib.contextmanager
def trainer_env() -> Iterator[None]:
    """``TRAINER_ENV`` in this process's environment while child processes are started."""
    saved = {k: os.environ.get(k) for k in TRAINER_ENV}
    os.environ.update(TRAINER_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 600) -> list[Any]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="rrl-dist-") as out:
        procs = [ctx.Process(target=_entry, args=(r, world, port, out, fn, args), daemon=True) for r in range(world)]
        with trainer_env():  # the children start with it, as the job's ranks do
            for p in procs:
                p.start()
        try:
            for p in procs:
                p.join(timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(10)
        results = []
        for r, p in enumerate(procs):
            f = Path(out) / f"{r}.pkl"
            if not f.exists():
                raise RuntimeError(f"rank {r} of {world} left no result (exit code {p.exitcode}; timeout {timeout}s?)")
            res = pickle.loads(f.read_bytes())
            if "error" in res:
                raise RuntimeError(f"rank {r} of {world} failed:\n{res['error']}")
            results.append(res["ok"])
        return results
