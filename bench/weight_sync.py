"""Weight sync: seconds to bring N rollout workers (1, 2, 4) to a new policy version through
the object store, at 0.3M and ~100M parameters, against the memcpy floor.

.venv/bin/python -m bench weight-sync [--sizes 0.3M,100M] [--engines hf,vllm] [--workers 1,2,4]
    [--repeats 5] [--vllm-large]

What is measured, per (size, engine, N): one *sync* is the wall time from the trainer side's
publish until all N workers have answered that they hold the new version:

1. ``TrainerRank.publish()`` on a real trainer rank actor (world size 1, gloo): rank 0's
   ``_put_weights``, i.e. stage each bucket (views of the live tensors) and have the job's
   ``WeightStore`` actor (pinned to the driver's node, as ``TrainerGroup.start`` does, and
   sent ``warm`` without waiting, as it does too) pull it through rank 0's ``export``, then
   seal the version. This part is reported as *put s*.
2. ``RolloutWorker.load_weights.remote(version, ref)`` sent to each of the N workers at once,
   exactly as the runner does after a committed step (the reference as a top-level argument,
   so Ray fetches and deserialises the state dict before the method runs), then ``ray.get``
   of all the answers. The workers are the product's ``RolloutWorker`` actor class with the
   product's engines (HF ``load_state_dict``; vLLM ``collective_rpc`` + ``reload_weights``)
   and their etcd membership (``member.update(version=...)``).

Per worker it also reports *get s* (from the moment the load was sent until the method body
starts: Ray's dispatch, fetch from the shared-memory store and unpickling of the tensors) and
*load s* (the engine's ``load_weights``). These come from timestamps taken by a subclass,
:class:`TimedRolloutWorker`, that only wraps ``load_weights`` and the engine's
``load_weights`` with ``time.time()`` calls; all else is the product code.

Not the product path: no controller or runner (the driver plays the runner's part in the
step loop: publish, then send ``load_weights`` to every worker), the trainer rank trains no
step (its weights are the initial ones each time; the version number sent to the workers is
raised each sync, so each load really happens), and the workers generate nothing between
syncs. One warm-up sync per engine is left out of the figures. All processes run on one
machine (a single Ray node), so the object store transfer is shared memory, never network.

The floor is ``model bytes / bandwidth of a large tensor clone`` (``copy_bandwidth`` of
bench/checkpoint_stall.py, measured here): one copy of the weights, which no sync can beat;
the ratio is measured / floor. Ray, etcd and models live in a temporary folder removed at
the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import common

#: The demo's model (examples/copy-tiny.yaml) and a ~100M model of the same architecture.
SIZES: dict[str, dict[str, int]] = {
    "0.3M": {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 256},
    "100M": {"hidden_size": 1024, "num_layers": 9, "num_heads": 16, "num_kv_heads": 4, "intermediate_size": 2816},
}


def job_name(size: str, engine: str | None = None) -> str:
    """``ws-{size}`` for the trainer rank and weight store, ``ws-{size}-{engine}`` for rollout
    workers: no actor name is reused after a kill (Ray frees names asynchronously)."""
    return "-".join(["ws", size.lower().replace(".", "p"), *([engine] if engine else [])])


TOKEN = 1  # the fencing token the driver adopts the workers with (as a leader would)


def _timed_worker_class() -> type:
    """The product's ``RolloutWorker`` with timestamps around ``load_weights`` (see module doc)."""
    from resilient_rl.workers.rollout import RolloutWorker

    class TimedRolloutWorker(RolloutWorker):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.stamps: dict[str, float] = {}
            inner = self.engine.load_weights

            def engine_load(state_dict: dict[str, Any]) -> None:
                t0 = time.time()
                inner(state_dict)
                self.stamps["engine_s"] = time.time() - t0

            self.engine.load_weights = engine_load  # type: ignore[method-assign]

        def load_weights(self, version: int, state_dict: dict[str, Any]) -> int:
            self.stamps = {"enter": time.time()}
            out = super().load_weights(version, state_dict)
            self.stamps["exit"] = time.time()
            return out

        def last_stamps(self) -> dict[str, float]:
            return self.stamps

    return TimedRolloutWorker


def job_spec(size: str, engine: str, replicas: int, job: str) -> Any:
    from resilient_rl.spec import JobSpec

    return JobSpec.model_validate(
        {
            "name": job,
            "model": {"init": SIZES[size]},
            "task": {"kind": "copy", "min_len": 3, "max_len": 3},
            "rollout": {"replicas": replicas, "engine": engine, "kv_cache_gib": 1.0},
            "trainer": {"replicas": 1},
            "prompts_per_step": 16,
            "steps": 1,
        }
    )


def worker_env() -> dict[str, Any]:
    """The runtime environment the runner gives rollout workers (``Runner.runtime_env``)."""
    return {
        "env_vars": {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    }


class Bench:
    """Ray + etcd + one trainer rank + its weight store; rollout workers per engine."""

    def __init__(self, root: Path, etcd: str) -> None:
        self.root, self.etcd = root, etcd
        self.trainer: Any = None
        self.store: Any = None

    def start_trainer(self, size: str, model_dir: str) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from resilient_rl.workers.trainer import trainer_actor
        from resilient_rl.workers.weights import WeightStore

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        self.store = (
            ray.remote(WeightStore)
            .options(name=f"rrl:{job_name(size)}:weights:0", namespace="rrl", lifetime="detached", num_cpus=0,
                     scheduling_strategy=here)
            .remote()
        )  # fmt: skip
        ray.get(self.store.ping.remote())
        self.store.warm.remote()  # as TrainerGroup.start does: not waited for
        job = job_name(size)
        spec = job_spec(size, "hf", 1, job)
        self.trainer = (
            trainer_actor()
            .options(
                name=f"rrl:{job}:trainer:0", namespace="rrl", lifetime="detached", num_cpus=1, runtime_env=worker_env()
            )
            .remote(job, 0, 1, spec.to_json(), model_dir, str(self.root / "work"), self.etcd)
        )
        master = ray.get(self.trainer.address.remote())
        ray.get(self.trainer.setup.remote(master, None))
        ray.get(self.trainer.adopt.remote(TOKEN, spec.digest()))

    def stop_trainer(self) -> None:
        import ray

        for a in (self.trainer, self.store):
            if a is not None:
                ray.kill(a)
        self.trainer = self.store = None

    def start_workers(self, size: str, engine: str, n: int, model_dir: str) -> list[Any]:
        """``n`` rollout workers, joined (adopted at version 0) the way ``RolloutGroup`` does."""
        import ray

        from resilient_rl.job.actors import _remote_class

        job = job_name(size, engine)
        spec = job_spec(size, engine, n, job)
        cls: Any = _remote_class(_timed_worker_class())  # its concurrency groups declared, as RayActors does
        workers = [
            cls.options(name=f"rrl:{job}:rollout:{i}", namespace="rrl", lifetime="detached", num_cpus=1,
                        runtime_env=worker_env())
            .remote(job, i, spec.to_json(), model_dir, str(self.root / "work"), self.etcd)
            for i in range(n)
        ]  # fmt: skip
        ray.get([w.adopt.remote(TOKEN, spec.digest(), 0, None) for w in workers])
        return workers

    def sync(self, workers: list[Any], version: int) -> dict[str, Any]:
        """One publish + parallel load on ``workers``; every time in seconds."""
        import ray

        t0 = time.time()
        ref = ray.get(self.trainer.publish.remote())["weights"]
        t_put = time.time()
        loaded = ray.get([w.load_weights.remote(version, ref) for w in workers])
        t_end = time.time()
        if loaded != [version] * len(workers):
            raise RuntimeError(f"workers answered versions {loaded}, expected {version}")
        stamps = ray.get([w.last_stamps.remote() for w in workers])
        return {
            "sync_s": t_end - t0,
            "put_s": t_put - t0,
            "get_s": [s["enter"] - t_put for s in stamps],
            "load_s": [s["engine_s"] for s in stamps],
            "member_s": [s["exit"] - s["enter"] - s["engine_s"] for s in stamps],
            "answer_s": [t_end - s["exit"] for s in stamps],
        }


def model_stats(model_dir: str) -> tuple[int, int]:
    """(parameters, bytes) of the state dict a trainer rank publishes."""
    from safetensors import safe_open

    params = nbytes = 0
    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as f:
        for k in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            t = f.get_tensor(k)
            params += t.numel()
            nbytes += t.numel() * t.element_size()
    return params, nbytes


def object_store_error(gib: float | None) -> str | None:
    """Why ``--object-store-gib`` cannot be ``gib`` here, by the bounds ``rrl up`` applies."""
    from resilient_rl.local import PlatformError, check_object_store

    try:
        check_object_store(gib)
    except PlatformError as e:
        return str(e)
    return None if gib is None or gib > 0 else f"--object-store-gib {gib:g}: must be above 0"  # 0: Ray's default


def start_ray(temp: Path, object_store_gib: float | None = None, preallocate: bool = False) -> None:
    """A local Ray node for the bench. ``object_store_gib``: the object store's size (Ray's
    default, 30 % of memory, when None); ``preallocate``: Ray's ``preallocate_plasma_memory``,
    every page of the store written once at start, so that no put lands in untouched pages."""
    import ray

    from resilient_rl.local import ray_env

    os.environ.update(ray_env())
    if preallocate:
        os.environ["RAY_preallocate_plasma_memory"] = "1"
    ray.init(
        num_cpus=max(os.cpu_count() or 1, 8),
        namespace="rrl",
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=str(temp),
        _node_ip_address="127.0.0.1",
        object_store_memory=None if object_store_gib is None else int(object_store_gib * 2**30),
    )


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import ray

    from bench.checkpoint_stall import copy_bandwidth
    from resilient_rl.algo.tasks import VOCAB_CHARS
    from resilient_rl.local import free_ports, start_etcd
    from resilient_rl.spec import TinyModelInit
    from resilient_rl.workers.model_init import make_tiny_model

    clone_bw, warm_bw = copy_bandwidth()
    print(f"memcpy bandwidth: clone {clone_bw / 2**30:.2f} GiB/s, into a touched buffer {warm_bw / 2**30:.2f} GiB/s")
    port, peer = free_ports(2)
    etcd = start_etcd(root / "etcd", port, peer, root / "etcd.log")
    t0 = time.monotonic()
    start_ray(root / "ray", args.object_store_gib, args.preallocate)
    print(f"Ray up in {time.monotonic() - t0:.1f} s (object store "
          f"{'default size' if args.object_store_gib is None else f'{args.object_store_gib:g} GiB'}"
          f"{', preallocated' if args.preallocate else ''})")  # fmt: skip
    bench = Bench(root, f"127.0.0.1:{port}")
    sizes: dict[str, Any] = {}
    runs: list[dict[str, Any]] = []
    warmups: list[dict[str, Any]] = []
    try:
        for size in args.sizes:
            model_dir = str(make_tiny_model(root / f"model-{size}", TinyModelInit(**SIZES[size]), VOCAB_CHARS))
            params, nbytes = model_stats(model_dir)
            floor_s = nbytes / clone_bw
            sizes[size] = {"init": SIZES[size], "params": params, "bytes": nbytes, "floor_s": floor_s}
            print(f"\n{size}: {params:,} parameters, {nbytes:,} bytes ({nbytes / 2**20:.1f} MiB) float32; "
                  f"floor {floor_s * 1e3:.2f} ms")  # fmt: skip
            t0 = time.monotonic()
            bench.start_trainer(size, model_dir)
            print(f"  trainer rank + weight store up in {time.monotonic() - t0:.1f} s")
            for engine in args.engines:
                if engine == "vllm" and size != "0.3M" and not args.vllm_large:
                    print("  vllm: skipped at this size (--vllm-large to include it)")
                    continue
                n_max = max(args.workers)
                t0 = time.monotonic()
                workers = bench.start_workers(size, engine, n_max, model_dir)
                print(f"  {engine}: {n_max} workers started and joined in {time.monotonic() - t0:.1f} s")
                version = 1
                warm = bench.sync(workers, version)  # first load of each worker: left out
                warmups.append({"size": size, "engine": engine, "workers": n_max, **warm})
                print(f"  {engine}: warm-up sync to {n_max} workers {warm['sync_s']:.3f} s (not counted) = put "
                      f"{warm['put_s']:.3f} (the first publish after the store started"
                      f"{'' if engine == args.engines[0] else ': no, an earlier engine published first'}) + get "
                      f"{max(warm['get_s']):.3f} + load {max(warm['load_s']):.3f}", flush=True)  # fmt: skip
                for rep in range(args.repeats):
                    for n in args.workers:  # interleaved, so drift in machine load hits every N alike
                        version += 1
                        r = bench.sync(workers[:n], version)
                        runs.append({"size": size, "engine": engine, "workers": n, "repeat": rep, **r})
                        print(f"  {engine} N={n} rep {rep}: sync {r['sync_s']:.3f} s = put {r['put_s']:.3f} + "
                              f"get {max(r['get_s']):.3f} + load {max(r['load_s']):.3f} (max over workers) "
                              f"+ rest", flush=True)  # fmt: skip
                for w in workers:
                    ray.get(w.shutdown.remote())
                    ray.kill(w)
            bench.stop_trainer()
    finally:
        ray.shutdown()
        etcd.stop()
    return {"sizes": sizes, "runs": runs, "warmups": warmups, "clone_bw": clone_bw, "warm_bw": warm_bw}


def summarise(data: dict[str, Any], workers: list[int]) -> list[dict[str, Any]]:
    rows = []
    keys = sorted({(r["size"], r["engine"]) for r in data["runs"]}, key=lambda k: (list(SIZES).index(k[0]), k[1]))
    for size, engine in keys:
        for n in workers:
            rs = [r for r in data["runs"] if (r["size"], r["engine"], r["workers"]) == (size, engine, n)]
            if not rs:
                continue
            floor_s = data["sizes"][size]["floor_s"]
            sync = common.summary([r["sync_s"] for r in rs])
            rows.append(
                {
                    "size": size,
                    "params": data["sizes"][size]["params"],
                    "engine": engine,
                    "workers": n,
                    "sync_s": sync,
                    "put_s": common.summary([r["put_s"] for r in rs]),
                    "get_s": common.summary([x for r in rs for x in r["get_s"]]),
                    "load_s": common.summary([x for r in rs for x in r["load_s"]]),
                    "member_s": common.summary([x for r in rs for x in r["member_s"]]),
                    "floor_s": floor_s,
                    "ratio": {k: v / floor_s if k != "n" else v for k, v in sync.items()},
                }
            )
    return rows


def tables(rows: list[dict[str, Any]]) -> str:
    main_t = common.table(
        ["params", "engine", "N workers", "sync s median (min-max)", "floor s", "ratio median (min-max)"],
        [
            [f"{r['params']:,}", r["engine"], r["workers"], common.fmt(r["sync_s"], 3), f"{r['floor_s']:.5f}",
             common.fmt(r["ratio"], 0)]
            for r in rows
        ],
    )  # fmt: skip
    parts = common.table(
        ["params", "engine", "N", "put s", "get s (per worker)", "engine load s (per worker)", "etcd update s"],
        [
            [f"{r['params']:,}", r["engine"], r["workers"], common.fmt(r["put_s"], 3), common.fmt(r["get_s"], 3),
             common.fmt(r["load_s"], 3), common.fmt(r["member_s"], 3)]
            for r in rows
        ],
    )  # fmt: skip
    return main_t + "\n\nComponents, median (min-max); per-worker figures pool all workers of all repeats:\n\n" + parts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench weight-sync", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0.3M,100M", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--engines", default="hf,vllm", help="comma-separated: hf, vllm")
    ap.add_argument("--workers", default="1,2,4", help="comma-separated worker counts")
    ap.add_argument("--repeats", type=int, default=5, help="syncs per (size, engine, N)")
    ap.add_argument("--vllm-large", action="store_true", help="also run vLLM at sizes above 0.3M")
    ap.add_argument("--no-save", action="store_true", help="do not write bench/results/weight_sync.json")
    ap.add_argument("--object-store-gib", type=float, default=None,
                    help="the object store's size in GiB (default: Ray's, 30%% of memory)")  # fmt: skip
    ap.add_argument("--preallocate", action="store_true",
                    help="write every page of the object store at start (Ray's preallocate_plasma_memory)")  # fmt: skip
    args = ap.parse_args(argv)
    args.sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.workers = sorted(int(n) for n in args.workers.split(","))
    bad = [s for s in args.sizes if s not in SIZES] + [e for e in args.engines if e not in ("hf", "vllm")]
    if bad or args.repeats < 1 or min(args.workers) < 1:
        ap.error(f"bad --sizes/--engines/--workers/--repeats: {bad or 'counts must be >= 1'}")
    if error := object_store_error(args.object_store_gib):
        ap.error(error)
    m = common.machine()
    print(f"$ {common.command_line()}\n{common.machine_line(m)}")
    root = Path(tempfile.mkdtemp(prefix="rrl-ws-", dir="/tmp"))  # short: Ray's socket paths
    try:
        data = run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = summarise(data, args.workers)
    out = tables(rows)
    print(f"\n{out}")
    if not args.no_save:
        path = common.save("weight_sync", {"machine_at_start": m, "rows": rows, **data})
        print(f"\nwrote {path.relative_to(common.ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
