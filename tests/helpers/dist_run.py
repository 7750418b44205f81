"""Run a function on ``world`` real processes joined in one gloo process group (no Ray).

For tests of the trainer's core (DDP and FSDP2 over gloo on the CPU): each rank runs
``fn(rank, world, *args)`` in a spawned process; rank results come back in rank order, and
a rank that raised or died fails the call with its traceback. Processes are this test's
own children, ended by PID on timeout.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from resilient_rl.local import free_port


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


def run(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 600) -> list[Any]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="rrl-dist-") as out:
        procs = [ctx.Process(target=_entry, args=(r, world, port, out, fn, args), daemon=True) for r in range(world)]
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
