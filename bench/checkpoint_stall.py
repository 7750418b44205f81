"""How long does a snapshot stall training? Blocking time of each way to snapshot a >= 100M
parameter model + AdamW, against the memcpy floor, and the step-time overhead of async
snapshots every step vs every 10 steps.

.venv/bin/python -m bench checkpoint [--params-m 100] [--snapshots 3] [--steps 10] [--repeats 2] [--dir TMP]

Single process, CPU. Per snapshot it prints the blocking seconds of DCP ``async_save``,
torchsnapshot ``async_take``, a synchronous ``torch.save`` (no fsync: page cache), and the
floor ``state bytes / bandwidth of a large tensor clone`` (a staging copy cannot beat it);
also the background write time (async_save to wait() returning) and the rank-0 manifest
time (fsync + sha256 of every file, :func:`checkpoints.snapshots.write_manifest`).
Everything is written under a temporary folder that is removed at the end. Figures are
medians (min-max) over the snapshots, and over ``--repeats`` step-time runs (each run
measures none / every 10 / every 1 back to back, so load drift hits them alike); results
go to ``bench/results/checkpoint.json``.
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import fmt, machine_line, save, table
from checkpoints.backends import make_backend, training_state
from checkpoints.snapshots import collect_garbage, snapshot_dir, write_manifest

WIDTH = 3584  # 8 layers of 3584x3584 (+bias) = 102.8M parameters for --params-m 100


def build(params_m: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    layers = max(1, math.ceil(params_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step(model, opt)  # fills exp_avg / exp_avg_sq
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """The synthetic training step: a small batch forward/backward, then AdamW over all params."""
    opt.zero_grad(set_to_none=True)
    model(torch.randn(8, WIDTH)).square().mean().backward()
    opt.step()


def state_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(state_bytes(v) for v in state)
    return 0


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 3) -> tuple[float, float]:
    """Bytes/s of ``clone()`` of a large tensor (fresh allocation, page faults included, like
    an uncached staging copy) and of ``copy_`` into a buffer already touched (pure memcpy)."""
    src = torch.ones(nbytes // 4)
    clone = warm = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        dst = src.clone()
        clone = min(clone, time.perf_counter() - t0)
        t0 = time.perf_counter()
        dst.copy_(src)
        warm = min(warm, time.perf_counter() - t0)
        del dst
    return nbytes / clone, nbytes / warm


def blocking_table(
    model: torch.nn.Module, opt: torch.optim.Optimizer, root: Path, n: int, floor_s: float
) -> dict[str, list[float]]:
    """Per snapshot: blocking, write and manifest seconds of each method; returns the columns."""
    backends = {name: make_backend(name) for name in ("dcp", "torchsnapshot")}
    print(
        f"{'snap':>4} {'dcp block':>10} {'ts block':>9} {'torch.save':>10} {'memcpy':>7}   "
        f"{'dcp write':>9} {'ts write':>8} {'manifest':>8}  (seconds)"
    )
    step = 0
    cols: dict[str, list[float]] = {}
    for i in range(n):
        row: dict[str, float] = {}
        for name, b in backends.items():
            step += 1
            d = snapshot_dir(root / name, step)
            t0 = time.perf_counter()
            pending = b.async_save(training_state(model, opt, {"step": step}), d)
            row[f"{name} block"] = pending.blocking_s
            pending.wait()
            row[f"{name} write"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            write_manifest(d, {"step": step, "backend": name})
            row[f"{name} manifest"] = time.perf_counter() - t1
            collect_garbage(root / name, {step})
        f = root / "torch-save.pt"
        t0 = time.perf_counter()
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
        row["save"] = time.perf_counter() - t0
        f.unlink()
        print(
            f"{i:>4} {row['dcp block']:>10.3f} {row['torchsnapshot block']:>9.3f} {row['save']:>10.3f} "
            f"{floor_s:>7.3f}   {row['dcp write']:>9.3f} {row['torchsnapshot write']:>8.3f} "
            f"{row['dcp manifest']:>8.3f}",
            flush=True,
        )
        for k, v in row.items():
            cols.setdefault(k, []).append(v)
        train_step(model, opt)  # the next snapshot sees new values
    return cols


def step_times(
    model: torch.nn.Module, opt: torch.optim.Optimizer, root: Path, backend: str, every: int, steps: int
) -> float:
    """Mean step time with an async snapshot every ``every`` steps (0: never). At most one in
    flight: a snapshot due while the previous one is still writing waits for it (that stall
    counts). The manifest is left out: it can run off the training thread."""
    b = make_backend(backend)
    pending = None
    times = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        train_step(model, opt)
        if every and step % every == 0:
            if pending is not None:
                pending.wait()
            pending = b.async_save(training_state(model, opt), snapshot_dir(root / backend, step))
        times.append(time.perf_counter() - t0)
        if pending is not None and pending.done():
            pending.wait()
            collect_garbage(root / backend, set())
            pending = None
    if pending is not None:
        pending.wait()
    collect_garbage(root / backend, set())
    return statistics.mean(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench checkpoint", description=__doc__.splitlines()[0])
    ap.add_argument("--params-m", type=float, default=100.0, help="model size in millions of parameters")
    ap.add_argument("--snapshots", type=int, default=3, help="snapshots per method in the blocking table")
    ap.add_argument("--steps", type=int, default=10, help="training steps per step-time measurement")
    ap.add_argument("--repeats", type=int, default=2, help="step-time runs per backend")
    ap.add_argument("--dir", default=None, help="parent of the temporary folder (default: system temp)")
    args = ap.parse_args(argv)
    print(machine_line(), f"; {torch.get_num_threads()} torch threads")
    torch.manual_seed(0)
    model, opt = build(args.params_m)
    nparams = sum(p.numel() for p in model.parameters())
    nbytes = state_bytes(training_state(model, opt))
    bw, warm_bw = copy_bandwidth()
    floor_s = nbytes / bw
    print(
        f"state: {nparams / 1e6:.1f}M parameters + AdamW = {nbytes / 2**30:.2f} GiB; "
        f"clone bandwidth {bw / 2**30:.1f} GiB/s -> memcpy floor {floor_s:.3f} s "
        f"(into a touched buffer: {warm_bw / 2**30:.1f} GiB/s, {nbytes / warm_bw:.3f} s)"
    )
    root = Path(tempfile.mkdtemp(prefix="ckpt-stall-", dir=args.dir))
    steps: dict[str, dict[str, list[float]]] = {}
    try:
        print("\nblocking time per snapshot (write = async_save until wait() returns; manifest = dcp's)")
        cols = blocking_table(model, opt, root, args.snapshots, floor_s)
        print(f"\nmean step time over {args.steps} steps (async snapshot, one in flight), {args.repeats} runs")
        for r in range(args.repeats):
            for backend in ("dcp", "torchsnapshot"):
                d = steps.setdefault(backend, {"none": [], "every 10": [], "every 1": []})
                d["none"].append(step_times(model, opt, root, backend, 0, args.steps))
                d["every 10"].append(step_times(model, opt, root, backend, 10, args.steps))
                d["every 1"].append(step_times(model, opt, root, backend, 1, max(5, args.steps // 2)))
                print(
                    f"  run {r}: {backend:>13} none {d['none'][-1]:.3f} s, every 10 {d['every 10'][-1]:.3f} s, "
                    f"every 1 {d['every 1'][-1]:.3f} s",
                    flush=True,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"\nBlocking seconds per snapshot, median (min-max) over {args.snapshots} snapshots\n")
    rows = [
        [name, fmt(cols[key], 3), f"{statistics.median(cols[key]) / floor_s:.2f}x"]
        for name, key in (("DCP async_save", "dcp block"), ("torchsnapshot async_take", "torchsnapshot block"),
                          ("torch.save (sync, page cache)", "save"))
    ]  # fmt: skip
    rows.append(["memcpy floor (state bytes / clone bandwidth)", f"{floor_s:.3f}", "1.00x"])
    print(table(["method", "blocking s", "vs floor"], rows))
    print("\nbackground write s: DCP " + fmt(cols["dcp write"]) + ", torchsnapshot " + fmt(cols["torchsnapshot write"]))
    print("DCP manifest s (fsync + sha256, off the training thread): " + fmt(cols["dcp manifest"]))
    print("\nStep-time overhead of async snapshots, median (min-max) over runs\n")
    srows = []
    for backend, d in steps.items():
        ten = [100 * (t / b - 1) for t, b in zip(d["every 10"], d["none"], strict=True)]
        one = [100 * (t / b - 1) for t, b in zip(d["every 1"], d["none"], strict=True)]
        srows.append([backend, fmt(d["none"], 3), fmt(d["every 10"], 3), fmt(ten, 0) + " %", fmt(one, 0) + " %"])
    print(table(["backend", "step s, no snapshot", "step s, every 10", "overhead every 10", "overhead every 1"], srows))
    path = save(
        "checkpoint",
        {"params": nparams, "state_bytes": nbytes, "clone_bw": bw, "floor_s": floor_s, "blocking": cols,
         "step_times": steps},
    )  # fmt: skip
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
