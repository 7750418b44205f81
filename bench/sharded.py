"""The sharded trainer's costs: memory per rank, step time and publish time, DDP vs FSDP2.

.venv/bin/python -m bench sharded [--repeats 2] [--steps 3]

World 2 on this machine's CPU (gloo, one torch thread per rank), a randomly initialised
Qwen2-shape model of ~105M parameters (hidden 768, 14 layers) with AdamW, 2 prompts x 4
samples per step. Each repeat runs DDP and then FSDP, each in a fresh pair of processes
(the product's ``TrainCore``, started by ``resilient_rl.workers.local_group``), and measures
per rank:

- *peak memory above baseline*: the process's peak RSS (``ru_maxrss``) minus its RSS after
  the imports, before the model is built; the largest of the two ranks;
- *step time*: seconds per ``TrainCore.train`` after the first step (warm-up);
- *publish*: seconds for rank 0 to get the whole weights as buckets (``TrainCore.buckets``,
  ``trainer.publish_bucket_mb`` 64: under FSDP each rank sends its shards to rank 0), against
  two floors: one memcpy of that many bytes into a touched buffer, and one copy into fresh
  memory (section 3's floor; each published version is a new object). (Putting the buckets into Ray's object
  store is the same for both strategies: ``python -m bench weight-sync`` measures it.)

- *shadow copy*: the blocking part of ``TrainCore.shadow_state`` (staging this rank's part of
  the state into buffers reused from the copy before, as a rank does after each step; the
  hand-over to the weight store then runs in a thread), its size per rank, and the blocking
  part of a DCP ``async_save`` of the same state (its own staging copy).

- *state sketch*: ``TrainCore.sketch`` (each train step returns it, the commit records it, a
  hot recovery's survivor must still show it), against the full ``fingerprint`` (a pass over
  the whole state, run only at the end of a hot recovery), and the sketch as a share of a step.

- *state transfer* (DDP): ``TrainCore.share_state``, the broadcast of rank 0's whole state
  (model, optimizer, RNG) that a newcomer receives in a hot recovery, with the state
  fingerprint hashed as it crosses, against one memcpy of the state.

Results go to ``bench/results/sharded.json``.
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import fmt, machine_line, save, table

BIG = {"hidden_size": 768, "num_layers": 14, "num_heads": 12, "num_kv_heads": 4, "intermediate_size": 2560}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _batches(steps: int, vocab: int) -> list[list[dict[str, Any]]]:
    rng = random.Random(0)
    out = []
    for _ in range(steps):
        batch = []
        for p in range(2):
            prompt = [rng.randrange(3, vocab) for _ in range(8)]
            for i in range(4):
                batch.append(
                    {
                        "prompt_index": p,
                        "sample": i,
                        "prompt_ids": prompt,
                        "version": 0,
                        "reward": rng.random(),
                        "token_ids": [rng.randrange(3, vocab) for _ in range(16)],
                    }
                )
        out.append(batch)  # fmt: skip
    return out


def measure(
    rank: int, world: int, spec_json: str, model_dir: str, strategy: str, steps: int, snap_dir: str
) -> dict[str, Any]:
    """One rank's figures (runs in a process of ``local_group``)."""
    import torch
    import transformers  # noqa: F401  (in the baseline: both strategies import it)

    from resilient_rl.algo.tasks import VOCAB_CHARS
    from resilient_rl.spec import JobSpec
    from resilient_rl.workers.model_init import build_vocab
    from resilient_rl.workers.train_core import TrainCore

    base = _rss()
    spec = JobSpec.model_validate_json(spec_json)
    core = TrainCore(spec, model_dir, rank, world, strategy)
    batches = _batches(steps, len(build_vocab(VOCAB_CHARS)))
    times = []
    for b in batches:
        t0 = time.perf_counter()
        core.train(b)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    size = sum(t.numel() * t.element_size() for bucket in core.buckets(64 << 20) for _, t in bucket)
    publish = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base  # before the floor's own buffers
    # the shadow copy's blocking part (staging into reused buffers, as the rank does after a
    # step) against the blocking part of an async DCP snapshot of the same state
    buf: dict[str, Any] = {}
    shadow = []
    for _ in range(3):
        t0 = time.perf_counter()
        buf, _tree = core.shadow_state(buf)
        shadow.append(time.perf_counter() - t0)
    shadow_bytes = sum(t.numel() * t.element_size() for t in buf.values())
    del buf
    # the state sketch each step returns (and the commit records) against the full fingerprint
    sketch = []
    for _ in range(5):
        t0 = time.perf_counter()
        core.sketch()
        sketch.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    core.fingerprint()
    fingerprint = time.perf_counter() - t0
    share = None
    if strategy == "ddp":  # a hot recovery's state transfer: rank 1 receives rank 0's whole state
        t0 = time.perf_counter()
        fp = core.share_state(0)  # with the fingerprint, hashed as the state crosses
        share = time.perf_counter() - t0
        if fp != core.fingerprint():
            raise RuntimeError("the fingerprint hashed during the transfer is not the state's")
    from checkpoints.backends import make_backend

    t0 = time.perf_counter()
    pending = make_backend("dcp").async_save(core.training_state({"step": core.step}), Path(snap_dir))
    snap_block = time.perf_counter() - t0
    pending.wait()
    floor = floor_fresh = None
    if rank == 0:
        src = torch.ones(size // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            dst.copy_(src)
            runs.append(time.perf_counter() - t0)
        floor = min(runs)
        fresh = []
        for _ in range(3):  # into new memory, as each published version is a new object
            t0 = time.perf_counter()
            c = src.clone()
            fresh.append(time.perf_counter() - t0)
            del c
        floor_fresh = min(fresh)
    params = sum(p.numel() for p in core.module.parameters()) if strategy == "ddp" else None
    return {"peak_bytes": peak, "step_s": times[1:] or times, "publish_s": publish, "floor_s": floor,
            "fresh_floor_s": floor_fresh, "bytes": size, "params": params, "shadow_s": shadow[1:],
            "shadow_bytes": shadow_bytes, "snapshot_block_s": snap_block, "sketch_s": min(sketch),
            "fingerprint_s": fingerprint, "share_s": share}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="DDP vs FSDP2 memory, step time and publish time (see the module doc)")
    ap.add_argument("--repeats", type=int, default=2, help="fresh DDP + FSDP process pairs (default 2)")
    ap.add_argument("--steps", type=int, default=3, help="train steps per run; the first is warm-up (default 3)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.steps < 2:
        print("--repeats >= 1 and --steps >= 2", file=sys.stderr)
        return 2
    from resilient_rl.algo.tasks import VOCAB_CHARS
    from resilient_rl.spec import parse_spec
    from resilient_rl.workers import local_group
    from resilient_rl.workers.model_init import make_tiny_model

    spec = parse_spec({"name": "bench-sharded", "model": {"init": BIG}, "prompts_per_step": 2,
                       "rollout": {"sampling": {"n": 4}}, "trainer": {"micro_batch": 4, "lr": 1e-4}})  # fmt: skip
    assert spec.model.init is not None
    runs: dict[str, list[list[dict[str, Any]]]] = {"ddp": [], "fsdp": []}
    with tempfile.TemporaryDirectory(prefix="rrl-bench-sharded-") as tmp:
        model_dir = str(make_tiny_model(Path(tmp) / "model", spec.model.init, VOCAB_CHARS))
        for rep in range(args.repeats):
            for strategy in ("ddp", "fsdp"):
                snap = str(Path(tmp) / f"snap-{rep}-{strategy}")
                ranks = local_group.run(2, measure, spec.to_json(), model_dir, strategy, args.steps, snap, timeout=900)
                runs[strategy].append(ranks)
                r0 = ranks[0]
                print(f"  rep {rep} {strategy}: peak {max(r['peak_bytes'] for r in ranks) / 2**30:.2f} GiB/rank, "
                      f"step {min(r0['step_s']):.2f} s, publish {r0['publish_s']:.2f} s", flush=True)  # fmt: skip
    params = runs["ddp"][0][0]["params"]
    peak = {s: [max(r["peak_bytes"] for r in ranks) / 2**30 for ranks in runs[s]] for s in runs}
    step = {s: [sum(ranks[0]["step_s"]) / len(ranks[0]["step_s"]) for ranks in runs[s]] for s in runs}
    pub = {s: [ranks[0]["publish_s"] for ranks in runs[s]] for s in runs}
    floor = [ranks[0]["floor_s"] for s in runs for ranks in runs[s]]
    fresh = [ranks[0]["fresh_floor_s"] for s in runs for ranks in runs[s]]
    ratio_mem = [f / d for f, d in zip(peak["fsdp"], peak["ddp"], strict=True)]
    ratio_step = [f / d for f, d in zip(step["fsdp"], step["ddp"], strict=True)]
    ratio_pub = [p / fl for p, fl in zip(pub["fsdp"], floor[args.repeats :], strict=True)]
    ratio_fresh = [p / fl for p, fl in zip(pub["fsdp"], fresh[args.repeats :], strict=True)]
    shadow = {s: [max(min(r["shadow_s"]) for r in ranks) for ranks in runs[s]] for s in runs}
    shadow_gib = {s: [max(r["shadow_bytes"] for r in ranks) / 2**30 for ranks in runs[s]] for s in runs}
    snap_block = {s: [max(r["snapshot_block_s"] for r in ranks) for ranks in runs[s]] for s in runs}
    sketch = {s: [max(r["sketch_s"] for r in ranks) for ranks in runs[s]] for s in runs}
    fprint = {s: [max(r["fingerprint_s"] for r in ranks) for ranks in runs[s]] for s in runs}
    share = [max(r["share_s"] for r in ranks) for ranks in runs["ddp"]]
    state_bytes = [max(r["shadow_bytes"] for r in ranks) for ranks in runs["ddp"]]
    copy_s = [b / (ranks[0]["bytes"] / ranks[0]["floor_s"]) for b, ranks in zip(state_bytes, runs["ddp"], strict=True)]
    print(f"\n{machine_line()}\n{params / 1e6:.1f}M parameters + AdamW, world 2, {args.repeats} repeat(s)\n")
    print(table(["", "DDP", "FSDP", "FSDP / DDP"], [
        ["peak memory above baseline, GiB per rank", fmt(peak["ddp"]), fmt(peak["fsdp"]), fmt(ratio_mem)],
        ["step time, s", fmt(step["ddp"]), fmt(step["fsdp"]), fmt(ratio_step)],
        ["whole weights to rank 0 in buckets, s", fmt(pub["ddp"], 3), fmt(pub["fsdp"], 3), fmt(
            [f / d for f, d in zip(pub["fsdp"], pub["ddp"], strict=True)])],
        ["shadow copy: blocking s per copy (staging, reused buffers)", fmt(shadow["ddp"], 3), fmt(shadow["fsdp"], 3),
         fmt([f / d for f, d in zip(shadow["fsdp"], shadow["ddp"], strict=True)])],
        ["shadow copy: GiB per rank", fmt(shadow_gib["ddp"]), fmt(shadow_gib["fsdp"]),
         fmt([f / d for f, d in zip(shadow_gib["fsdp"], shadow_gib["ddp"], strict=True)])],
        ["DCP async snapshot: blocking s", fmt(snap_block["ddp"], 3), fmt(snap_block["fsdp"], 3),
         fmt([f / d for f, d in zip(snap_block["fsdp"], snap_block["ddp"], strict=True)])],
        ["state sketch per step (what the commit records), ms", fmt([x * 1e3 for x in sketch["ddp"]], 2),
         fmt([x * 1e3 for x in sketch["fsdp"]], 2), ""],
        ["full state fingerprint (recovery only), s", fmt(fprint["ddp"], 2), fmt(fprint["fsdp"], 2), ""],
        ["hot recovery: the whole state to a newcomer (broadcast), s", fmt(share, 2), "-", ""],
        ["  its floor: one memcpy of the state, s", fmt(copy_s, 2), "-", ""],
        ["sketch / step time", fmt([a / b for a, b in zip(sketch["ddp"], step["ddp"], strict=True)], 5),
         fmt([a / b for a, b in zip(sketch["fsdp"], step["fsdp"], strict=True)], 5), ""],
    ]))  # fmt: skip
    mib = runs["ddp"][0][0]["bytes"] / 2**20
    print(
        f"\nthe {mib:.0f} MiB of weights: memcpy into a touched buffer {fmt(floor, 3)} s (FSDP publish / it: "
        f"{fmt(ratio_pub)}); a copy into fresh memory {fmt(fresh, 3)} s (FSDP publish / it: {fmt(ratio_fresh)})"
    )
    save(
        "sharded",
        {
            "params": params,
            "runs": runs,
            "peak_gib": peak,
            "step_s": step,
            "publish_s": pub,
            "floor_s": floor,
            "fresh_floor_s": fresh,
            "shadow_s": shadow,
            "shadow_gib": shadow_gib,
            "snapshot_block_s": snap_block,
            "sketch_s": sketch,
            "fingerprint_s": fprint,
            "share_s": share,
            "state_memcpy_s": copy_s,
            "ratios": {"memory": ratio_mem, "step": ratio_step, "publish": ratio_pub, "publish_fresh": ratio_fresh},
        },
    )
    return 0
