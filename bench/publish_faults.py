"""Page faults of a publish: rank 0's minor faults (from ``/proc/PID/stat``) and the time of each
of a few publishes in a row, at ~100M parameters, with Ray's default object store or a
preallocated one. Shows what the first publishes pay that later ones do not (BENCHMARKS.md
section 4): every page of the object store a version lands in must be mapped into rank 0's
process, the writer, the first time it writes there, and, unless the store was written at
start, also allocated and zeroed.

    .venv/bin/python -m bench.publish_faults [--preallocate] [--object-store-gib 4] [--publishes 6] [--populate]

``--populate`` first maps the whole store into rank 0's process in one call,
``madvise(MADV_POPULATE_WRITE)`` over its mapping of the store's file (Linux 5.14+), run in the
rank through Ray's ``__ray_call__``: the experiment behind BENCHMARKS.md's note that the mapping
is what the first publishes pay. Only with ``--preallocate``: on a store not written at start it
would allocate every page of it.

No rollout worker loads the versions: publishes follow each other, and the store keeps the
versions it keeps, so later ones land in pages not used before for longer than in
``bench weight-sync``, where the workers' loads come between.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench import common
from bench import weight_sync as ws


def minor_faults(pid: int) -> int:
    """The process's minor page faults so far (field 10 of ``/proc/PID/stat``)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


def populate_store_mapping(_actor: object = None) -> list[dict[str, float]]:
    """In the calling process: ``madvise(MADV_POPULATE_WRITE)`` over each mapping of Ray's
    object store file (``/dev/shm/plasma...``). Returns per mapping its size, the bytes its file
    holds, madvise's return code and errno, and the seconds it took."""
    import ctypes
    import os

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if "/plasma" not in line:
            continue
        span = line.split()[0]
        lo, hi = (int(x, 16) for x in span.split("-"))
        held = os.stat(f"/proc/self/map_files/{span}").st_blocks * 512
        t0 = time.monotonic()
        rc = libc.madvise(lo, hi - lo, 23)  # MADV_POPULATE_WRITE
        out.append({"bytes": hi - lo, "file_bytes": held, "rc": rc, "errno": ctypes.get_errno() if rc else 0,
                    "seconds": round(time.monotonic() - t0, 3)})  # fmt: skip
    return out


def run(args: argparse.Namespace, root: Path) -> None:
    import ray

    from resilient_rl.algo.tasks import VOCAB_CHARS
    from resilient_rl.local import free_ports, start_etcd
    from resilient_rl.spec import TinyModelInit
    from resilient_rl.workers.model_init import make_tiny_model

    port, peer = free_ports(2)
    etcd = start_etcd(root / "etcd", port, peer, root / "etcd.log")
    gib = args.object_store_gib  # None: Ray's default (not --preallocate)
    ws.start_ray(root / "ray", gib, args.preallocate)
    print(f"object store: {'default size' if gib is None else f'{gib:g} GiB'}"
          f"{', preallocated' if args.preallocate else ''}")  # fmt: skip
    try:
        bench = ws.Bench(root, f"127.0.0.1:{port}")
        model = str(make_tiny_model(root / "model", TinyModelInit(**ws.SIZES["100M"]), VOCAB_CHARS))
        _, nbytes = ws.model_stats(model)
        bench.start_trainer("100M", model)
        spec = ws.job_spec("100M", "hf", 1, ws.job_name("100M"))
        pid = ray.get(bench.trainer.adopt.remote(ws.TOKEN, spec.digest()))["pid"]
        if args.populate:
            for m in ray.get(bench.trainer.__ray_call__.remote(populate_store_mapping)):
                print(f"rank 0's mapping of the store populated: {m['bytes'] / 2**30:.2f} GiB (its file holds "
                      f"{m['file_bytes'] / 2**30:.2f}) in {m['seconds']:.3f} s, rc {m['rc']} errno {m['errno']}")  # fmt: skip
        print(f"100M: {nbytes / 2**20:.1f} MiB a version, {nbytes // 4096:,} pages of 4 KiB; rank 0 is pid {pid}")
        for v in range(args.publishes):
            f0, t0 = minor_faults(pid), time.monotonic()
            ray.get(bench.trainer.publish.remote())
            dt, faults = time.monotonic() - t0, minor_faults(pid) - f0
            print(f"publish {v}: {dt:.3f} s, rank 0's minor faults {faults:,} ({faults * 4096 / 2**20:.0f} MiB)",
                  flush=True)  # fmt: skip
        bench.stop_trainer()
    finally:
        ray.shutdown()
        etcd.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.publish_faults", description=__doc__.splitlines()[0])
    ap.add_argument("--preallocate", action="store_true", help="write every page of the object store at start")
    ap.add_argument("--object-store-gib", type=float, default=4.0,
                    help="the object store's size with --preallocate (default 4; without it: Ray's default)")  # fmt: skip
    ap.add_argument("--publishes", type=int, default=6, help="publishes in a row (1-50)")
    ap.add_argument("--populate", action="store_true",
                    help="map the whole store into rank 0 first (madvise MADV_POPULATE_WRITE); needs --preallocate")  # fmt: skip
    args = ap.parse_args(argv)
    if args.populate and not args.preallocate:
        ap.error("--populate needs --preallocate (it would allocate every page of a store not written at start)")
    if not 1 <= args.publishes <= 50:
        ap.error("--publishes must be within 1-50")
    if not args.preallocate:
        args.object_store_gib = None
    if error := ws.object_store_error(args.object_store_gib):
        ap.error(error)
    line = " ".join(shlex.quote(a) for a in [".venv/bin/python", "-m", "bench.publish_faults", *sys.argv[1:]])
    print(f"$ {line}\n{common.machine_line(common.machine())}")
    root = Path(tempfile.mkdtemp(prefix="rrl-pf-", dir="/tmp"))  # short: Ray's socket paths
    try:
        run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    from resilient_rl.signals import exit_on_sigterm

    exit_on_sigterm()
    raise SystemExit(main())
