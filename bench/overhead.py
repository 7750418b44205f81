"""Orchestration overhead: what running GRPO through rrl costs against a bare loop.

.venv/bin/python -m bench overhead [--repeats 3] [--steps tiny=60,1s=25] [--sizes tiny,1s]
                                   [--engine vllm|hf] [--warmup 5] [--profile DIR]

The same GRPO work (model, task, prompts per step, samples per prompt, engine, learning
rate, optimizer, KL to the initial model, trainer world size 1, a weight load into the
engine after every step) is run three ways:

(a) ``bare``: one process, no Ray, no etcd, no journal, written here. It builds the model
    the job's ``model.init`` describes, the task, the engine class the rollout worker uses
    (:func:`resilient_rl.workers.engines.make_engine`) and the trainer's optimizer and reference
    model, then per step: the prompts of the step (:func:`resilient_rl.algo.sampler.prompt_indices`),
    one ``generate`` of ``prompts x n`` completions with the per-sample seeds and rewards as
    :meth:`RolloutWorker.generate_shard` makes them, the train step of
    :meth:`TrainerRank.train_step` (same advantages, micro-batches, loss, clipping) and
    ``engine.load_weights`` of a cloned state dict. It runs in a child process of its own
    (torch threads as in the rrl workers: ``RRL_WORKER_THREADS``, default 1, set before the
    engine starts because vLLM's CPU worker freezes ``torch.set_num_threads`` afterwards).
(b) ``rrl s=0``: the same job submitted to rrl with ``async.max_staleness: 0``
    (1 rollout worker, 1 trainer rank, each a Ray actor with 1 CPU thread);
(c) ``rrl s=1``: the same with ``max_staleness: 1`` (rollouts of step k+1 overlap training
    of step k).

All rrl runs share one isolated local platform (etcd, Ray head, one controller) started
once. The bare loop snapshots nothing, so the rrl jobs set ``checkpoint.every`` beyond the
last step (no snapshot is ever taken); the journal, etcd commits and membership updates stay
on (they are what rrl is). Steps/s is the steady state: the commit time stamps of every step
after the first ``--warmup`` ones (``metrics.jsonl``'s ``time`` for rrl, the same point of
the loop for the bare run), ``(stamps - 1) / (last - first)``; engine start-up and the first
steps are excluded alike. Repeats are interleaved (a, b, c, a, b, c, ...) so a change in the
machine's load hits all three; every figure is the median (min-max) over the repeats, the
ratios are per repeat (b_i / a_i) so drift between repeats cancels.

Sizes: ``tiny`` is the ``make demo`` job (examples/copy-tiny.yaml: 0.3M parameters, 16
prompts x 8 samples, 8 tokens) with trainer replicas 1; ``1s`` is a wider and deeper model
(hidden 256, 4 heads of 64, 2 layers, MLP 512: 1.2M parameters) with the same batch, where a bare step
takes about 1 s on a 2-core machine (the bare step time is printed). With ``--profile DIR``
one bare run runs under pyinstrument and one rrl run (s=0) under py-spy (rollout worker,
trainer rank, controller; on-CPU shares of the wall) plus a per-step timeline from journal file
times, for the analysis; the profiles are written to DIR and nothing is saved to results.

Engine: vLLM by default, the engine of the demo job and the one rrl is built around (in-place
weight reload); ``--engine hf`` runs all three variants with the HF engine instead.

Load: ``--load N`` starts N busy-looping processes of the benchmark's own (nice 0, children
of this process, each in a session of its own, ended by handle) once the platform is up, and keeps them running through
every variant and repeat: the machine is then loaded by a known amount, the same for the
bare loop and rrl, and each run records the 1-minute load average at its end. With the
per-step critical-path budget rrl's runs print, an idle run and a loaded one show what load
adds to each hand-off.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import ROOT, fmt, job_metrics, local_platform, machine, machine_line, run_job, save, summary, table

#: ``checkpoint.every`` for the rrl runs: beyond any step, so no snapshot is taken (the bare loop takes none).
NO_SNAPSHOT = 10_000_000  # the bound of checkpoint.every (spec.py)
#: py-spy samples per second (rrl profile)
PYSPY_RATE = 100


@dataclass(frozen=True)
class Size:
    """One job size: the model and the batch."""

    name: str
    init: dict[str, int]
    prompts_per_step: int
    n: int
    max_tokens: int
    steps: int  # default --steps


SIZES: dict[str, Size] = {
    # examples/copy-tiny.yaml (the `make demo` job), trainer replicas 1
    "tiny": Size("tiny", {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1}, 16, 8, 8, 60),
    # ~1 s per bare step on 2 cores (1.2M parameters); head_dim 64 (vLLM's CPU kernels accept 64 and 128)
    "1s": Size(
        "1s",
        {"hidden_size": 256, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 512},
        16,
        8,
        8,
        25,
    ),
}

VARIANTS: tuple[tuple[str, int | None], ...] = (("bare", None), ("rrl s=0", 0), ("rrl s=1", 1))


def job_spec(size: Size, name: str, steps: int, engine: str, staleness: int) -> dict[str, Any]:
    """The job both the bare loop and rrl run (the bare loop ignores ``async``, replicas, checkpoint)."""
    return {
        "name": name,
        "model": {"init": dict(size.init)},
        "task": {"kind": "copy", "min_len": 3, "max_len": 3},
        "rollout": {
            "replicas": 1,
            "engine": engine,
            "sampling": {"temperature": 1.0, "max_tokens": size.max_tokens, "n": size.n},
        },
        "trainer": {"replicas": 1, "lr": 0.001},
        "algorithm": {"normalize_std": False, "kl_coef": 0.02},
        "async": {"max_staleness": staleness},
        "prompts_per_step": size.prompts_per_step,
        "steps": steps,
        "seed": 0,
        "checkpoint": {"every": NO_SNAPSHOT},
    }


def steady_rate(stamps: list[float], warmup: int) -> float:
    """Steps/s over the commit stamps after the first ``warmup`` steps."""
    ts = stamps[warmup:]
    if len(ts) < 2 or ts[-1] <= ts[0]:
        return math.nan
    return (len(ts) - 1) / (ts[-1] - ts[0])


# -- (a) the bare loop (runs in a child process) --------------------------------------------


def bare_loop(spec_dict: dict[str, Any], workdir: Path, warmup: int, profile: Path | None = None) -> dict[str, Any]:
    """Run the job's GRPO steps in this process, mirroring RolloutWorker.generate_shard and
    TrainerRank.train_step (world size 1) without journal, etcd or Ray; returns the timings."""
    import torch

    # as the rrl workers do, and before the engine starts (vLLM freezes set_num_threads afterwards)
    torch.set_num_threads(max(1, int(os.environ.get("RRL_WORKER_THREADS", "1"))))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoModelForCausalLM

    from resilient_rl.algo.grpo import group_advantages, grpo_loss, sequence_logprobs
    from resilient_rl.algo.sampler import prompt_indices, sample_seed
    from resilient_rl.algo.tasks import VOCAB_CHARS, make_task
    from resilient_rl.spec import parse_spec
    from resilient_rl.workers.engines import Sampling, make_engine
    from resilient_rl.workers.model_init import make_tiny_model
    from resilient_rl.workers.trainer import batch_tensors

    t_start = time.monotonic()
    spec = parse_spec(spec_dict, "overhead")
    assert spec.model.init is not None
    model_dir = str(make_tiny_model(workdir / "model", spec.model.init, VOCAB_CHARS))
    task = make_task(spec.task, spec.seed)
    r = spec.rollout
    sampling = Sampling(r.sampling.temperature, r.sampling.top_p, r.sampling.max_tokens)
    engine = make_engine(r.engine, model_dir, spec.model.dtype, r.kv_cache_gib, spec.seed)

    # TrainerRank.setup, world size 1 (no DDP wrapper, as there)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(spec.seed)
    dtype = getattr(torch, spec.model.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.train()
    t = spec.trainer
    params = [p for p in model.parameters() if p.requires_grad]
    opt: torch.optim.Optimizer
    if t.optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
    else:
        opt = torch.optim.SGD(params, lr=t.lr, weight_decay=t.weight_decay)
    ref_model = None
    if spec.algorithm.kl_coef > 0:
        ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        ref_model.eval()
    pad = int(model.config.pad_token_id if model.config.pad_token_id is not None else 0)
    n = r.sampling.n
    world = 1
    start_s = time.monotonic() - t_start

    stamps: list[float] = []
    phases: list[dict[str, float]] = []
    rewards_mean: list[float] = []
    profiler: Any = None
    for k in range(spec.steps):
        if profile is not None and k == warmup:
            from pyinstrument import Profiler

            profiler = Profiler(interval=0.002)
            profiler.start()
        t0, c0 = time.perf_counter(), time.process_time()
        # -- RolloutWorker.generate_shard (one shard: one rollout replica) --
        idx = prompt_indices(spec.seed, k, spec.prompts_per_step, len(task))
        examples = [task.example(i) for i in idx]
        prompts, seeds, keys = [], [], []
        for ex in examples:
            for s in range(n):
                prompts.append(ex.prompt)
                seeds.append(sample_seed(spec.seed, k, ex.index, s))
                keys.append((ex, s))
        outs = engine.generate(prompts, seeds, sampling)
        samples = []
        for (ex, s), c in zip(keys, outs, strict=True):
            rr = task.reward(ex, c.text)
            samples.append(
                {
                    "prompt_index": ex.index,
                    "sample": s,
                    "prompt_ids": c.prompt_ids,
                    "token_ids": c.token_ids,
                    "logprobs": [x if math.isfinite(x) else None for x in c.logprobs],
                    "text": c.text,
                    "reward": rr.value,
                    "reward_error": rr.error,
                    "version": k,
                }
            )
        t1 = time.perf_counter()
        # -- TrainerRank.train_step, world size 1 --
        rewards = torch.tensor([x["reward"] for x in samples], dtype=torch.float64).view(-1, n)
        adv = group_advantages(rewards, spec.algorithm.normalize_std).view(-1).float()
        total = len(samples)
        opt.zero_grad(set_to_none=True)
        mb = t.micro_batch
        loss_sum = torch.zeros((), dtype=torch.float64)
        for start in range(0, total, mb):
            part = samples[start : start + mb]
            bt = batch_tensors(part, pad)
            new_lp = sequence_logprobs(model, bt["input_ids"], bt["attention_mask"], bt["completion_mask"])
            old_lp = new_lp.detach()
            ref_lp = None
            if ref_model is not None:
                with torch.no_grad():
                    ref_lp = sequence_logprobs(ref_model, bt["input_ids"], bt["attention_mask"], bt["completion_mask"])
            seq_loss, _stats = grpo_loss(
                new_lp,
                old_lp,
                adv[start : start + mb],
                bt["completion_mask"],
                spec.algorithm.clip_eps,
                spec.algorithm.kl_coef,
                ref_lp,
            )
            (seq_loss.sum() * (world / total)).backward()
            loss_sum += seq_loss.detach().double().sum()
        if t.max_grad_norm is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
            if not (torch.isfinite(grad_norm) and torch.isfinite(loss_sum)):
                raise RuntimeError(f"step {k}: non-finite loss or gradient")
        opt.step()
        t2 = time.perf_counter()
        # -- publish + RolloutWorker.load_weights --
        state = {name: v.detach().clone() for name, v in model.state_dict().items()}
        engine.load_weights(state)
        t3 = time.perf_counter()
        stamps.append(time.time())
        cpu = time.process_time() - c0  # CPU seconds of this process (all threads): the step on an idle core
        phases.append({"generate_s": t1 - t0, "train_s": t2 - t1, "sync_s": t3 - t2, "step_s": t3 - t0, "cpu_s": cpu})
        rewards_mean.append(float(rewards.mean()))
        print(f"    bare step {k}: {t3 - t0:.3f} s (generate {t1 - t0:.3f}, train {t2 - t1:.3f}, "
              f"sync {t3 - t2:.3f}; cpu {cpu:.3f}) reward {rewards_mean[-1]:.3f}", flush=True)  # fmt: skip
    if profiler is not None and profile is not None:
        profiler.stop()
        profile.mkdir(parents=True, exist_ok=True)
        (profile / "bare.txt").write_text(profiler.output_text(unicode=False, color=False, show_all=False))
        (profile / "bare.html").write_text(profiler.output_html())
    steady = phases[warmup:]
    return {
        "start_s": start_s,
        "stamps": stamps,
        "rewards": rewards_mean,
        "steps_per_s": steady_rate(stamps, warmup),
        "phases_mean": {p: statistics.fmean(x[p] for x in steady) for p in steady[0]} if steady else {},
        "params": sum(p.numel() for p in model.parameters()),
    }


def run_bare(spec: dict[str, Any], tmp: Path, warmup: int, profile: Path | None = None) -> dict[str, Any]:
    """Run :func:`bare_loop` in a fresh child process; returns its result."""
    work = Path(tempfile.mkdtemp(prefix=f"{spec['name']}-", dir=tmp))
    (work / "spec.json").write_text(json.dumps(spec))
    out = work / "result.json"
    cmd = [sys.executable, "-m", "bench", "overhead", "--bare-child", str(work), "--warmup", str(warmup)]
    if profile is not None:
        cmd += ["--profile", str(profile)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode or not out.exists():
        tail = "\n".join(proc.stdout.splitlines()[-30:])
        raise RuntimeError(f"bare run {spec['name']} failed (exit {proc.returncode}):\n{tail}")
    res = dict(json.loads(out.read_text()))
    res["wall_s"] = time.monotonic() - t0
    shutil.rmtree(work, ignore_errors=True)
    return res


def bare_child(work: Path, warmup: int, profile: Path | None) -> int:
    spec = json.loads((work / "spec.json").read_text())
    res = bare_loop(spec, work, warmup, profile)
    (work / "result.json").write_text(json.dumps(res))
    return 0


# -- (b), (c) through rrl ---------------------------------------------------------------------


def journal_generate_s(home: Path, name: str, warmup: int) -> float:
    """Mean seconds a rollout worker spent on a shard (its journal meta), after the warm-up."""
    secs = []
    for f in sorted((home / "jobs" / name / "journal").glob("step-*/shard-*.json")):
        step = int(f.parent.name.split("-")[1])
        if step >= warmup:
            secs.append(float(json.loads(f.read_text())["meta"]["seconds"]))
    return statistics.fmean(secs) if secs else math.nan


def run_rrl(client: Any, home: Path, spec: dict[str, Any], warmup: int) -> dict[str, Any]:
    t0 = time.monotonic()
    rec = run_job(client, spec, timeout=1800, progress=lambda m: print(m, flush=True))
    wall = time.monotonic() - t0
    if rec["phase"] != "SUCCEEDED":
        raise RuntimeError(f"rrl job {spec['name']} ended {rec['phase']}: {rec.get('state', {}).get('reason')}")
    rows = sorted(job_metrics(home, spec["name"]), key=lambda r: int(r["step"]))
    stamps = [float(r["time"]) for r in rows]
    steady = rows[warmup:]
    return {
        "wall_s": wall,
        "stamps": stamps,
        "rewards": [float(r["reward"]) for r in rows],
        "steps_per_s": steady_rate(stamps, warmup),
        "step_seconds_mean": statistics.fmean(float(r["step_seconds"]) for r in steady) if steady else math.nan,
        "generate_s_mean": journal_generate_s(home, spec["name"], warmup),
        "critical_path_ms": critical_path(home, spec["name"], warmup),
    }


def profile_rrl(client: Any, home: Path, spec: dict[str, Any], warmup: int, out: Path) -> None:
    """One rrl run with py-spy recording the rollout worker and the trainer rank (steady state)."""
    from controller.jobs import TERMINAL

    client.post("/api/v1/jobs", {"spec": spec})
    name = spec["name"]
    out.mkdir(parents=True, exist_ok=True)
    while True:  # wait for the warm-up to pass
        rec = client.get(f"/api/v1/jobs/{name}")
        if rec["phase"] in TERMINAL:
            raise RuntimeError(f"{name} ended before it could be profiled: {rec['phase']}")
        if int(rec.get("state", {}).get("step", 0)) >= warmup:
            break
        time.sleep(0.5)
    members = client.get(f"/api/v1/jobs/{name}/members")  # {group: [{id, pid, ...}]}
    pids = {f"{group}{row['id']}": int(row["pid"]) for group, rows in members.items() for row in rows if row.get("pid")}
    with contextlib.suppress(OSError, ValueError, KeyError):
        plat = json.loads((home / "platform.json").read_text())
        pids["controller"] = int(plat["processes"]["controller-0"]["pid"])
    print(f"  py-spy on {pids}", flush=True)
    secs = max(5, int((spec["steps"] - warmup) * 0.6))
    spy = str(Path(sys.executable).parent / "py-spy")
    procs = []
    for label, pid in pids.items():
        cmd = [spy, "record", "--pid", str(pid), "--duration", str(secs), "--rate", str(PYSPY_RATE), "--nonblocking"]
        cmd += ["--format", "raw", "-o", str(out / f"rrl-{label}.folded")]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate()
        if p.returncode:
            print(f"  py-spy failed: {err.strip()[-300:]}", flush=True)
    for label in pids:
        folded = out / f"rrl-{label}.folded"
        if folded.exists():
            text = top_frames(folded, PYSPY_RATE * secs)
            (out / f"rrl-{label}.top.txt").write_text(text)
            print(f"  {label} (py-spy, on-CPU samples as % of {secs} s wall):\n{text}", flush=True)
    while client.get(f"/api/v1/jobs/{name}")["phase"] not in TERMINAL:
        time.sleep(0.5)
    rows = job_metrics(home, name)
    print(f"  profiled rrl run: {steady_rate([float(r['time']) for r in rows], warmup):.3f} steps/s", flush=True)
    text = step_timeline(home, name, warmup)
    (out / "rrl-timeline.txt").write_text(text + "\n")
    print(text, flush=True)


def step_timeline(home: Path, name: str, warmup: int) -> str:
    """Where an on-policy (s=0) rrl step's wall time goes, from file times: commit of step k-1
    -> shard of step k in the journal (weight load, dispatch, generation, journal write) -> its
    batch manifest (the controller noticing, commit_batch) -> commit of step k (train dispatch,
    journal read, train step, weight publish, etcd commit, metrics line)."""
    rows = {int(r["step"]): float(r["time"]) for r in job_metrics(home, name)}
    journal = home / "jobs" / name / "journal"
    parts: dict[str, list[float]] = {"to shard written": [], "to batch committed": [], "to step committed": []}
    for k in sorted(rows):
        if k < warmup or k - 1 not in rows:
            continue
        shards = list((journal / f"step-{k:08d}").glob("shard-*.json"))
        batch = journal / f"step-{k:08d}" / "batch.json"
        if not shards or not batch.exists():
            continue
        t_shard, t_batch = max(f.stat().st_mtime for f in shards), batch.stat().st_mtime
        parts["to shard written"].append(t_shard - rows[k - 1])
        parts["to batch committed"].append(t_batch - t_shard)
        parts["to step committed"].append(rows[k] - t_batch)
    lines = [f"rrl step timeline (mean s over {len(parts['to shard written'])} steps, from the previous commit):"]
    lines += [f"  {k:20s} {statistics.fmean(v):.3f}" for k, v in parts.items() if v]
    return "\n".join(lines)


#: The hand-offs of one step on the on-policy critical path, from the metrics line's ``trace``
#: (``JobRunner._committed``, ``TrainerRank._train_step``) and the journal's file times: each
#: is (label, from, to); "prev:" names the previous step's trace.
HAND_OFFS: tuple[tuple[str, str, str], ...] = (
    ("weights out -> last shard journaled (load, generate, write)", "prev:handed_off", "shard"),
    ("-> batch manifest journaled", "shard", "batch"),
    ("-> train_step sent (the runner notices)", "batch", "sent"),
    ("-> rank starts the step (call delivery)", "sent", "start"),
    ("journal read", "start", "read"),
    ("train", "read", "trained"),
    ("membership, shadow, sketch", "trained", "bookkept"),
    ("publish (the store pulls the buckets)", "bookkept", "published"),
    ("-> result seen by the runner", "published", "seen"),
    ("-> weights handed off, next shards sent", "seen", "handed_off"),
)


def critical_path(home: Path, name: str, warmup: int) -> dict[str, float]:
    """Mean milliseconds per hand-off of a step (see HAND_OFFS), over the steps after the
    warm-up; ``step`` is their sum (one step's period: hand-off to hand-off) and ``commit
    behind`` how long the fenced commit's line took after the hand-off (off the path)."""
    rows = {int(r["step"]): r for r in job_metrics(home, name)}
    journal = home / "jobs" / name / "journal"
    parts: dict[str, list[float]] = {label: [] for label, _, _ in HAND_OFFS}
    parts["step"], parts["commit behind (line written)"] = [], []
    for k in sorted(rows):
        tr, prev = rows[k].get("trace"), (rows.get(k - 1) or {}).get("trace")
        if k < warmup or not tr or not prev:
            continue
        shards = list((journal / f"step-{k:08d}").glob("shard-*.json"))
        batch = journal / f"step-{k:08d}" / "batch.json"
        if not shards or not batch.exists():
            continue
        t = {**tr, "shard": max(f.stat().st_mtime for f in shards), "batch": batch.stat().st_mtime}
        t.update({f"prev:{key}": v for key, v in prev.items()})
        if any(a not in t or b not in t for _, a, b in HAND_OFFS):
            continue
        for label, a, b in HAND_OFFS:
            parts[label].append(1e3 * (t[b] - t[a]))
        parts["step"].append(1e3 * (t["handed_off"] - t["prev:handed_off"]))
        parts["commit behind (line written)"].append(1e3 * (float(rows[k]["time"]) - t["handed_off"]))
    return {k: statistics.fmean(v) for k, v in parts.items() if v}


def critical_path_text(budget: dict[str, float]) -> str:
    if not budget:
        return "  (no traced steps)"
    return "\n".join(f"    {k:58s} {v:8.1f} ms" for k, v in budget.items())


def top_frames(folded: Path, wall_samples: int, n: int = 25) -> str:
    """The ``n`` functions with the most inclusive on-CPU samples in a py-spy raw (folded)
    profile, as a share of ``wall_samples`` (rate x duration: 100% = busy all the time)."""
    incl: dict[str, int] = {}
    total = 0
    for line in folded.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        total += int(count)
        for frame in set(stack.split(";")):
            incl[frame] = incl.get(frame, 0) + int(count)
    top = sorted(incl.items(), key=lambda kv: -kv[1])[:n]
    head = f"{100 * total / max(wall_samples, 1):6.1f}%  (all on-CPU samples)"
    return "\n".join([head, *(f"{100 * c / max(wall_samples, 1):6.1f}%  {f}" for f, c in top)])


# -- main ---------------------------------------------------------------------------------------


def parse_steps(text: str, sizes: list[str]) -> dict[str, int]:
    """``60`` (every size) or ``tiny=60,1s=25``."""
    out = {s: SIZES[s].steps for s in sizes}
    for part in text.split(",") if text else []:
        if "=" in part:
            k, v = part.split("=", 1)
            out[k.strip()] = int(v)
        else:
            out = {s: int(part) for s in sizes}
    return out


#: a background load process: a busy loop until it is ended (``--load``)
BUSY = "while True:\n    pass\n"


@contextlib.contextmanager
def background_load(n: int) -> Any:
    """``n`` busy-looping child processes for the block's duration (none for 0), ended by handle.

    Each in a session of its own, as programs started apart from this one are: Linux's
    autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``) shares the CPU between
    sessions first, so a load in this process's session would fall on the bare loop (its child)
    alone and spare rrl's workers, which run in the Ray head's session."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY], stdin=subprocess.DEVNULL, start_new_session=True)
             for _ in range(n)]  # fmt: skip
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of (bare, rrl s=0, rrl s=1)")
    ap.add_argument("--steps", default="", help="steps per run: N for every size or tiny=60,1s=25 (the defaults)")
    ap.add_argument("--sizes", default="tiny,1s", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument(
        "--engine",
        choices=("vllm", "hf"),
        default="vllm",
        help="rollout engine for all three variants (default vllm, as the demo job)",
    )
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out of steps/s")
    ap.add_argument("--load", type=int, default=0, metavar="N",
                    help="N busy-looping processes of the benchmark's own running through every run (a load of "
                         "known size, the same for bare and rrl; default 0: none)")  # fmt: skip
    ap.add_argument("--variants", default="bare,s0,s1", help=argparse.SUPPRESS)
    ap.add_argument("--profile", type=Path, default=None, help="profile one bare and one rrl run per size into DIR")
    ap.add_argument("--bare-child", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.bare_child is not None:
        return bare_child(args.bare_child, args.warmup, args.profile)

    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        ap.error(f"unknown size(s) {unknown}; choose from {', '.join(SIZES)}")
    steps = parse_steps(args.steps, sizes)
    if any(v < args.warmup + 3 for v in steps.values()):
        ap.error(f"--steps must be at least --warmup + 3 = {args.warmup + 3}")
    if not 0 <= args.load <= 64:
        ap.error(f"--load must be between 0 and 64 processes, not {args.load}")
    keep = {"bare": "bare", "s0": "rrl s=0", "s1": "rrl s=1"}
    variants = [(v, s) for v, s in VARIANTS if v in {keep[x] for x in args.variants.split(",")}]
    m = machine()
    print(f"machine: {machine_line(m)}", flush=True)
    print(f"engine {args.engine}, {args.repeats} repeats, steps {steps}, warm-up {args.warmup} steps, "
          f"background load {args.load} busy process(es)", flush=True)  # fmt: skip
    os.environ.setdefault("RRL_WORKER_THREADS", "1")

    runs: list[dict[str, Any]] = []
    tmp = Path(tempfile.mkdtemp(prefix="rrl-bench-overhead-"))
    t_all = time.monotonic()
    try:
        with local_platform(tmp / "home", progress=lambda *a: None) as (_, client), background_load(args.load):
            print(f"platform up after {time.monotonic() - t_all:.0f} s", flush=True)
            if args.profile is not None:
                for size in sizes:
                    sz = SIZES[size]
                    spec = job_spec(sz, f"ovh-prof-{size.replace('1s', 'one')}-bare", steps[size], args.engine, 0)
                    res = run_bare(spec, tmp, args.warmup, args.profile / size)
                    print(f"  profiled bare run: {res['steps_per_s']:.3f} steps/s", flush=True)
                    spec = job_spec(sz, f"ovh-prof-{size.replace('1s', 'one')}-s0", steps[size], args.engine, 0)
                    profile_rrl(client, tmp / "home", spec, args.warmup, args.profile / size)
                return 0
            for rep in range(args.repeats):
                for size in sizes:
                    sz = SIZES[size]
                    for variant, staleness in variants:
                        tag = {"bare": "bare", "rrl s=0": "s0", "rrl s=1": "s1"}[variant]
                        name = f"ovh-{size.replace('1s', 'one')}-{tag}-r{rep}"
                        spec = job_spec(sz, name, steps[size], args.engine, staleness or 0)
                        print(f"[{rep + 1}/{args.repeats}] {size} {variant}: {steps[size]} steps ...", flush=True)
                        t0 = time.monotonic()
                        if staleness is None:
                            res = run_bare(spec, tmp, args.warmup)
                            extra = (
                                f"; bare step {res['phases_mean']['step_s']:.3f} s = generate "
                                f"{res['phases_mean']['generate_s']:.3f} + train {res['phases_mean']['train_s']:.3f}"
                                f" + sync {res['phases_mean']['sync_s']:.3f}; {res['params'] / 1e6:.1f}M params"
                            )
                        else:
                            res = run_rrl(client, tmp / "home", spec, args.warmup)
                            extra = (
                                f"; mean step_seconds {res['step_seconds_mean']:.3f}, "
                                f"shard generate {res['generate_s_mean']:.3f} s; per step (mean):\n"
                                f"{critical_path_text(res['critical_path_ms'])}"
                            )
                        load1 = round(os.getloadavg()[0], 2)
                        res.update(size=size, variant=variant, repeat=rep, steps=steps[size], load_avg_end=load1)
                        runs.append(res)
                        print(f"[{rep + 1}/{args.repeats}] {size} {variant}: {res['steps_per_s']:.3f} steps/s "
                              f"({time.monotonic() - t0:.0f} s wall, load average {load1} at its end){extra}",
                              flush=True)  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not runs:
        return 1

    rows: list[list[str]] = []
    summaries: dict[str, Any] = {}
    for size in sizes:
        bare = {r["repeat"]: r["steps_per_s"] for r in runs if r["size"] == size and r["variant"] == "bare"}
        for variant, _ in variants:
            mine = [r for r in runs if r["size"] == size and r["variant"] == variant]
            rates = [r["steps_per_s"] for r in mine]
            ratios = [r["steps_per_s"] / bare[r["repeat"]] for r in mine if r["repeat"] in bare]
            summaries[f"{size}/{variant}"] = {"steps_per_s": summary(rates), "ratio_to_bare": summary(ratios)}
            ratio = "1" if variant == "bare" else fmt(ratios)
            rows.append([size, variant, fmt(rates), ratio])
        bare_step = [r["phases_mean"]["step_s"] for r in runs if r["size"] == size and r["variant"] == "bare"]
        if bare_step:
            summaries[f"{size}/bare_step_s"] = summary(bare_step)
            print(f"{size}: bare step {fmt(bare_step, 3)} s", flush=True)
            # what overlapping generation with training could reach at best, per repeat: the bare
            # step over its longer half (generate, or train + weight load); s=1 is held against it
            limits = {
                r["repeat"]: r["phases_mean"]["step_s"]
                / max(r["phases_mean"]["generate_s"], r["phases_mean"]["train_s"] + r["phases_mean"]["sync_s"])
                for r in runs
                if r["size"] == size and r["variant"] == "bare"
            }
            s1 = [r for r in runs if r["size"] == size and r["variant"] == "rrl s=1" and r["repeat"] in limits]
            if s1:
                of_limit = [r["steps_per_s"] / bare[r["repeat"]] / limits[r["repeat"]] for r in s1]
                summaries[f"{size}/overlap_limit"] = summary(list(limits.values()))
                summaries[f"{size}/s1_of_overlap_limit"] = summary(of_limit)
                print(f"{size}: overlap limit (bare step / max(generate, train + load)) {fmt(list(limits.values()))}; "
                      f"rrl s=1 / bare = {fmt(of_limit)} x the limit", flush=True)  # fmt: skip
    md = table(["size", "variant", "steps/s", "ratio to bare"], rows)
    print(f"\n{md}\n", flush=True)
    path = save(
        "overhead",
        {
            "machine_at_start": m,
            "engine": args.engine,
            "background_load": args.load,
            "repeats": args.repeats,
            "steps": steps,
            "warmup": args.warmup,
            "sizes": {s: SIZES[s].__dict__ for s in sizes},
            "summaries": summaries,
            "table": md,
            "runs": runs,
            "wall_s": time.monotonic() - t_all,
        },
    )
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
