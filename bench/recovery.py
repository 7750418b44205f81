"""Recovery under random faults: MTTR per fault kind and ETTR at one fault per 30 s and per 10 s.

.venv/bin/python -m bench recovery [--mtbf 30,10] [--duration 6m] [--seed 1] [--repeats 1]
.venv/bin/python -m bench recovery --trainer-kills 4 [--world 2] [--strategy fsdp]   # hot vs cold trainer recovery
.venv/bin/python -m bench recovery --rollout-kills 3                # rollout kills with a warm spare vs without

Each run is the chaos harness's soak (``rrl chaos soak``, scenarios/soak.yaml: the tiny
HF-engine copy job, 2 rollout workers, 1 trainer rank, 2 controllers, snapshot every 10
steps) with random faults of seven kinds (rollout kill / hang / slow, trainer kill / hang,
snapshot corruption + trainer kill, leader kill) at exponential gaps of mean ``--mtbf``, for
``--duration``. The harness checks all seven invariants afterwards (including a replay of
every step); a run whose invariants fail is reported as such, never dropped.

Figures per MTBF:

* ETTR between the first and the last fault against a **fault-free run** of the same job on
  the same machine, made first (``--reference-steps``, no fault injected): committed steps in
  the window x the reference run's mean wall seconds per step (its commits, snapshots and
  hand-offs included; its first 20 steps left out) / the window's length. 1.0 means the
  faults cost nothing. The reference run's own figures are printed too;
* the harness's own figure beside it (``goodput.ettr_window``: the same, with the soak's
  median ``step_seconds`` as the step: what the status page shows, which also counts the
  job's periodic costs, a snapshot every 10 steps, as lost); also ETTR over the whole
  training phase (which includes any fault-free tail);
* MTTR per kind: detection, next committed step, group back at its desired size (seconds
  after the injection), median (min-max) over the faults of that kind across repeats.

The job's step count is sized so that it outlasts the fault window (``--steps``, default
``duration x 15`` steps: 5 was enough at a 0.16 s step; at 0.09 s a 6-minute soak's job ended
after 190 s, a third of its faults not fired); a fault scheduled after the job has finished is reported as not
fired (the harness then exits 1; this benchmark counts it and goes on).
"""

from __future__ import annotations

import argparse
import bisect
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, fmt, machine_line, save, summary, table

FIGS = ("detection_s", "next_commit_s", "group_restored_s")


def parse_seconds(text: str) -> float:
    from resilient_rl.chaos.cli import parse_duration

    return float(parse_duration(text))


def soak(
    mtbf_s: float, duration_s: float, seed: int, steps: int, out: Path, scenario: Path | None = None
) -> dict[str, Any]:
    """One ``rrl chaos soak`` in a child process; returns its report.json (plus the exit code)."""
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.iterdir())
    argv = [
        str(Path(sys.executable).parent / "rrl"), "chaos", "soak",
        "--duration", f"{duration_s:.10g}s", "--mtbf", f"{mtbf_s:.10g}s", "--seed", str(seed),
        "--steps", str(steps), "--out", str(out), *(["--scenario", str(scenario)] if scenario else []),
    ]  # fmt: skip
    print(f"$ {' '.join(argv)}", flush=True)
    t0 = time.monotonic()
    rc = _run_child(argv)
    new = sorted(set(out.iterdir()) - before)
    reports = [d / "report.json" for d in new if (d / "report.json").exists()]
    if not reports:
        raise RuntimeError(f"the soak (exit {rc}) wrote no report.json under {out}")
    rep = dict(json.loads(reports[-1].read_text()))
    rep["exit_code"], rep["bench_wall_s"] = rc, round(time.monotonic() - t0, 1)
    return rep


#: steps of the fault-free reference run left out of its mean (start-up: the spares warming beside it)
REFERENCE_SKIP = 20


def reference_step_s(rep: dict[str, Any]) -> float:
    """The mean wall seconds per step of a fault-free run: the time between its commits, past
    its first ``REFERENCE_SKIP`` steps."""
    times = sorted(float(s["time"]) for s in rep.get("steps", []) if isinstance(s.get("time"), int | float))
    times = times[REFERENCE_SKIP:]
    if len(times) < 20:
        raise RuntimeError(f"the fault-free reference run committed {len(times)} steps past its first "
                           f"{REFERENCE_SKIP}: too few for a mean")  # fmt: skip
    return (times[-1] - times[0]) / (len(times) - 1)


#: seconds after a soak's last injection before its fault-free tail begins (a spare's refill ends)
TAIL_SETTLE_S = 30.0


def tail_step_s(rep: dict[str, Any], settle_s: float = TAIL_SETTLE_S) -> float | None:
    """The mean wall seconds per step of a soak's own fault-free tail: between its commits from
    ``settle_s`` after the last injection to the job's end (at least 100 of them, else None). A
    baseline from the same run, so a machine whose speed drifts between runs (two fault-free runs
    of the soak's job differed by up to 20 % a step here) does not move the ETTR."""
    inj = [float(f["injected_at"]) for f in rep.get("faults", []) if f.get("injected_at") is not None]
    if not inj:
        return None
    start = max(inj) + settle_s
    times = sorted(t for s in rep.get("steps", []) if isinstance(t := s.get("time"), int | float) and t >= start)
    if len(times) < 100:
        return None
    return (times[-1] - times[0]) / (len(times) - 1)


#: seconds after a fault over which :func:`speed_after` measures the job's speed
AFTER_S = 30.0


def speed_after(rep: dict[str, Any], step_s: float, after_s: float = AFTER_S) -> list[float | None]:
    """Per fault of ``rep`` (in order), the job's speed over the ``after_s`` seconds after its
    injection against a fault-free step of ``step_s``: ``step_s`` x the commits in
    ``[injected, injected + after_s)`` / ``after_s`` (None for a fault not injected). Below 1
    is what the fault cost beyond its stall as well: a replacement's start-up competing with
    the job for the CPUs, a retried step. The windows of close faults overlap; one that runs
    past the run's last commit counts the rest as lost."""
    times = sorted(float(t) for s in rep.get("steps", []) if isinstance(t := s.get("time"), int | float))
    out: list[float | None] = []
    for f in rep.get("faults", []):
        at = f.get("injected_at")
        if at is None:
            out.append(None)
            continue
        n = bisect.bisect_left(times, float(at) + after_s) - bisect.bisect_left(times, float(at))
        out.append(round(n * step_s / after_s, 3))
    return out


def ettr_vs_reference(rep: dict[str, Any], step_s: float) -> float | None:
    """ETTR between the soak's first and last injection, against the fault-free run's
    ``step_s``: the harness's ``ettr_window`` (committed steps in ``[first, last)`` x the step /
    the window, at most 1) with ``step_s`` as its baseline."""
    from resilient_rl.chaos import measure

    inj = [float(f["injected_at"]) for f in rep.get("faults", []) if f.get("injected_at") is not None]
    return measure.goodput({}, rep.get("steps", []), baseline_step_s=step_s, injections=inj).get("ettr_window")


def condense(rep: dict[str, Any]) -> dict[str, Any]:
    """What the tables need from one report (the full report stays in its run folder)."""
    faults = rep.get("faults", [])
    return {
        "run_dir": rep.get("run_dir"),
        "exit_code": rep.get("exit_code"),
        "job": rep.get("job"),
        "goodput": rep.get("goodput"),
        "lost_work": rep.get("lost_work"),
        "invariants": [{"number": i["number"], "ok": i["ok"]} for i in rep.get("invariants", [])],
        "injected": sum(f.get("status") == "injected" for f in faults),
        "scheduled": len(faults),
        "faults": [
            {"kind": f["kind"], "status": f.get("status"), **{k: (f.get("figures") or {}).get(k) for k in FIGS}}
            for f in faults
        ],
    }


# the >= 100M-parameter model of the sharded-trainer benchmarks (104.7M parameters, Qwen2 shape)
BIG = {"hidden_size": 768, "num_layers": 14, "num_heads": 12, "num_kv_heads": 4, "intermediate_size": 2560}


def trainer_scenario(
    hot: bool, kills: int, name: str, world: int = 2, big: bool = False, strategy: str = "ddp"
) -> dict[str, Any]:
    """A chaos scenario of ``kills`` trainer-rank SIGKILLs on a ``strategy`` job of ``world`` ranks, with
    ``trainer.hot_recovery`` on or off (at world 1 the hot path is the warm spare from the
    shadow copy). Kills are 24 steps apart at world 2; at world 1, 60 (about 20 s: a spare used
    by one kill is warm again, ~7 s here, before the next; faster faults meet no spare). With
    ``big`` the model is the 104.7M-parameter one (steps of seconds: kills 10 steps apart)."""
    gap = 10 if big else 24 if world > 1 else 60
    return {
        "name": name,
        "cluster": {"etcd_members": 1, "ray_nodes": 1, "controllers": 1, "leader_ttl": 5},
        "job": {
            "name": name, "model": {"init": BIG if big else {}}, "task": {"kind": "copy", "num_prompts": 64},
            "rollout": {"replicas": 1, "engine": "hf", "sampling": {"max_tokens": 6, "n": 4}, "spares": 0},
            "trainer": {"replicas": world, "lr": 1e-4 if big else 0.002, "hot_recovery": hot, "strategy": strategy},
            "prompts_per_step": 2 if big else 4, "steps": gap * kills + (6 if big else 12), "seed": 7,
            "checkpoint": {"every": 10, "keep": 2},
            "fault": {"hang_timeout": 60.0 if big else 5.0, "lease_ttl": 3},
        },
        "faults": [{"kind": "trainer_kill", "at": {"step": gap + gap * i}, "target": (1 - i % 2) % world}
                   for i in range(kills)],
        "settle_timeout_s": 240,
        "timeout_s": 900,
    }  # fmt: skip


def rollout_scenario(spare: bool, kills: int, name: str) -> dict[str, Any]:
    """A chaos scenario of ``kills`` rollout-worker SIGKILLs (2 workers, alternating) with a warm
    spare (``rollout.spares: 1``) or without (``0``: a new process after the backoff). Kills are
    80 steps apart (about 20 s: the spare used by one kill is warm again, ~7 s here, before the
    next; at 30 steps, 8 s, the second kill met no spare)."""
    gap = 80
    return {
        "name": name,
        "cluster": {"etcd_members": 1, "ray_nodes": 1, "controllers": 1, "leader_ttl": 5},
        "job": {
            "name": name, "model": {"init": {}}, "task": {"kind": "copy", "num_prompts": 64},
            "rollout": {"replicas": 2, "engine": "hf", "sampling": {"max_tokens": 6, "n": 4}, "spares": int(spare)},
            "trainer": {"replicas": 1, "lr": 0.002, "spares": 0},
            "prompts_per_step": 4, "steps": gap * kills + 12, "seed": 7,
            "checkpoint": {"every": 10, "keep": 2}, "fault": {"hang_timeout": 5.0, "lease_ttl": 3},
        },
        "faults": [{"kind": "rollout_kill", "at": {"step": gap + gap * i}, "target": i % 2} for i in range(kills)],
        "settle_timeout_s": 240,
        "timeout_s": 900,
    }  # fmt: skip


def rollout_paths(kills: int, out: Path) -> int:
    """Rollout-worker kills with a warm spare and without, in one run, side by side."""
    print(machine_line(), flush=True)
    rows, runs = [], {}
    for spare in (True, False):
        mode = "spare" if spare else "no spare"
        full, rc = _chaos_run(out / f"rollout-{'spare' if spare else 'none'}",
                              rollout_scenario(spare, kills, f"bench-rollout-{'spare' if spare else 'none'}"))  # fmt: skip
        rep = condense({**full, "exit_code": rc})
        joined = [e for e in full.get("events", []) if e.get("kind") == "rollout_joined" and e.get("recovery_s")]
        rep["joins"] = [{k: e.get(k) for k in ("worker", "recovery_s", "spare")} for e in joined]
        runs[mode] = rep
        fs = [f for f in rep["faults"] if f["status"] == "injected"]
        green = all(i["ok"] for i in rep["invariants"])
        rows.append([mode, f"{len(fs)}/{rep['scheduled']}", "green" if green else "**VIOLATED**",
                     *[fmt([f[c] for f in fs if f[c] is not None]) for c in FIGS],
                     fmt([j["recovery_s"] for j in rep["joins"]]),
                     f"{sum(bool(j.get('spare')) for j in rep['joins'])}/{len(rep['joins'])}"])  # fmt: skip
    print("\nRollout worker SIGKILLed (2 workers), seconds after injection, median (min-max) over faults\n")
    print(table(["replacement", "faults injected", "invariants", "detection", "next commit", "group size restored",
                 "fault -> joined (driver)", "warm spare used"], rows))  # fmt: skip
    path = save("recovery-rollout", {"kills": kills, "runs": runs})
    print(f"\nresults: {path}")
    return 0 if all(all(i["ok"] for i in r["invariants"]) for r in runs.values()) else 1


def _run_child(argv: list[str]) -> int:
    """Run an ``rrl chaos`` command to its end; its exit code. Stopped early (SIGTERM, Ctrl-C:
    :func:`resilient_rl.signals.exit_on_sigterm`) it is sent SIGTERM and waited for, so that it
    stops the platform it started (``subprocess.run`` would SIGKILL it, which leaves that
    platform running)."""
    p = subprocess.Popen(argv, cwd=ROOT)
    try:
        return p.wait()
    except BaseException:
        p.terminate()
        try:
            p.wait(timeout=180)
        except subprocess.TimeoutExpired:
            p.kill()
        raise


def _chaos_run(d: Path, scenario: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """``rrl chaos run`` of ``scenario`` in a child process, its run folder under ``d``: (report, exit code)."""
    import yaml

    d.mkdir(parents=True, exist_ok=True)
    sc = d / "scenario.yaml"
    sc.write_text(yaml.safe_dump(scenario))
    before = set(d.iterdir())
    argv = [str(Path(sys.executable).parent / "rrl"), "chaos", "run", str(sc), "--out", str(d)]
    print(f"$ {' '.join(argv)}", flush=True)
    rc = _run_child(argv)
    new = [x / "report.json" for x in sorted(set(d.iterdir()) - before) if (x / "report.json").exists()]
    if not new:
        raise RuntimeError(f"the chaos run (exit {rc}) wrote no report.json under {d}")
    return json.loads(new[-1].read_text()), rc


def memcpy_gbps() -> float:
    """This machine's memcpy bandwidth (GB/s): the best of 5 clones of a 256 MB tensor."""
    import torch

    x = torch.ones(64 * 1024 * 1024)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x.clone()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def mttr_bounds(runs: dict[str, dict[str, Any]], gbps: float, state_gb: float) -> dict[str, Any]:
    """Issue 16's bound on the hot next commit: the median detection + one step + 2 x state /
    memcpy, with "one step" the hot run's median step, and (stricter where the hot run's steps
    were slowed, e.g. by a spare warming beside them) the cold run's; and how many hot kills'
    next commits are under each, as "n/m"."""
    hot = [f for f in runs["hot"]["faults"] if f["status"] == "injected"]
    det = _median([f["detection_s"] for f in hot if f["detection_s"] is not None]) or 0.0
    nexts = [f["next_commit_s"] for f in hot if f.get("next_commit_s") is not None]
    step = _median([float(x) for x in runs["hot"].get("step_seconds") or []])
    cold = _median([float(x) for x in (runs.get("cold") or {}).get("step_seconds") or []])
    move = 2 * state_gb / gbps
    out: dict[str, Any] = {"memcpy_gbps": round(gbps, 2), "state_gb": round(state_gb, 3),
                           "median_step_s": round(step, 2) if step is not None else None,
                           "bound_s": round(det + step + move, 2) if step is not None else None,
                           "cold_median_step_s": round(cold, 2) if cold is not None else None,
                           "bound_cold_step_s": round(det + cold + move, 2) if cold is not None else None}  # fmt: skip
    for key, bound in (("under_bound", out["bound_s"]), ("under_bound_cold_step", out["bound_cold_step_s"])):
        out[key] = f"{sum(x <= bound for x in nexts)}/{len(nexts)}" if bound is not None else None
    return out


def trainer_paths(kills: int, out: Path, world: int = 2, big: bool = False, strategy: str = "ddp") -> int:
    """Trainer-rank kills at ``world``, the hot path and the cold path in one run, side by side.
    With ``big`` (the 104.7M model) the hot figure is set beside the issue's bound: detection +
    one step + 2 x (trainer state bytes / memcpy bandwidth)."""
    print(machine_line(), flush=True)
    rows, runs = [], {}
    tag = f"w{world}" + ("-100m" if big else "") + ("-fsdp" if strategy == "fsdp" else "")
    for hot in (True, False):
        mode = "hot" if hot else "cold"
        full, rc = _chaos_run(out / f"trainer-{tag}-{mode}",
                              trainer_scenario(hot, kills, f"bench-trainer-{tag}-{mode}", world, big, strategy))  # fmt: skip
        rep = condense({**full, "exit_code": rc})
        recs = [e for e in full.get("events", []) if e.get("kind") == "trainer_recovered"]
        rep["recoveries"] = [{k: e.get(k) for k in ("recovery", "seconds", "spares_used", "replayed", "phases")}
                             for e in recs]  # fmt: skip
        rep["step_seconds"] = [x["step_seconds"] for x in full.get("steps", []) if x.get("step_seconds")]
        runs[mode] = rep
        fs = [f for f in rep["faults"] if f["status"] == "injected"]
        green = all(i["ok"] for i in rep["invariants"])
        spared = sum(bool(r.get("spares_used")) for r in rep["recoveries"])
        rows.append([mode, f"{len(fs)}/{rep['scheduled']}", "green" if green else "**VIOLATED**",
                     *[fmt([f[c] for f in fs if f[c] is not None]) for c in FIGS],
                     fmt([r["seconds"] for r in rep["recoveries"] if r.get("seconds") is not None]),
                     f"{spared}/{len(rep['recoveries'])}"])  # fmt: skip
    print(f"\nTrainer rank SIGKILLed, world {world} {strategy.upper()}{' (104.7M parameters)' if big else ''}, seconds after "
          "injection, median (min-max) over faults\n")  # fmt: skip
    print(table(["recovery", "faults injected", "invariants", "detection", "next commit", "group size restored",
                 "recovery itself", "warm spare used"], rows))  # fmt: skip
    for r in runs["hot"]["recoveries"]:
        if r.get("phases"):  # where the driver's hot path spent its time (TrainerGroup.recover_hot)
            print("hot recovery phases, s: " + ", ".join(f"{k} {v}" for k, v in r["phases"].items()))
    extra: dict[str, Any] = {}
    if big:
        gbps = memcpy_gbps()
        state_gb = 104.7e6 * 4 * 3 / 1e9  # fp32 parameters + AdamW's two moments
        extra = mttr_bounds(runs, gbps, state_gb)
        print(f"\nbound: detection + one step ({extra['median_step_s']:.2f} s, the hot run's median) + 2 x "
              f"{state_gb:.2f} GB / {gbps:.1f} GB/s memcpy = {extra['bound_s']:.2f} s; hot next commits under it: "
              f"{extra['under_bound']}")  # fmt: skip
        if extra.get("bound_cold_step_s") is not None:
            print(f"stricter, with the cold run's median step ({extra['cold_median_step_s']:.2f} s): "
                  f"{extra['bound_cold_step_s']:.2f} s; under it: {extra['under_bound_cold_step']}")  # fmt: skip
    path = save(f"recovery-trainer-{tag}", {"kills": kills, "world": world, "runs": runs, **extra})
    print(f"\nresults: {path}")
    return 0 if all(all(i["ok"] for i in r["invariants"]) for r in runs.values()) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench recovery", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--trainer-kills",
        type=int,
        default=0,
        metavar="N",
        help="Instead of the soaks: N trainer-rank kills (--strategy, --world ranks), once with hot "
        "recovery and once with the cold path, MTTR side by side.",
    )
    ap.add_argument("--rollout-kills", type=int, default=0, metavar="N",
                    help="Instead of the soaks: N rollout-worker kills, once with a warm spare "
                    "(rollout.spares 1) and once without, MTTR side by side.")  # fmt: skip
    ap.add_argument("--model", choices=("tiny", "100m"), default="tiny",
                    help="The --trainer-kills job's model: the tiny one, or 104.7M parameters (Qwen2 shape).")  # fmt: skip
    ap.add_argument("--world", type=int, choices=(1, 2), default=2,
                    help="Trainer ranks of the --trainer-kills job (1: the spare takes over from the shadow copy).")  # fmt: skip
    ap.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp",
                    help="The --trainer-kills job's trainer.strategy (fsdp: the hot path loads the shadow copy).")  # fmt: skip
    ap.add_argument("--mtbf", default="30,10", help="Mean seconds between faults, comma-separated.")
    ap.add_argument("--duration", default="6m", help="Fault window per soak (e.g. 6m, 30m).")
    ap.add_argument("--seed", type=int, default=1, help="Seed of the first repeat's schedule (+1 per repeat).")
    ap.add_argument("--repeats", type=int, default=1, help="Soaks per MTBF.")
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="Job steps (default: duration in s x 15: at the soak's ~0.09 s step, the job outlasts the fault window).",
    )
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/rrl-bench-recovery"), help="Chaos run folders.")
    ap.add_argument("--scenario", type=Path, default=None,
                    help="Base scenario of the soaks and the reference run (default scenarios/soak.yaml; "
                         "scenarios/soak-spares2.yaml: two warm spares per group).")  # fmt: skip
    ap.add_argument("--reference-steps", type=int, default=600,
                    help="Steps of each fault-free reference run (its mean wall seconds per step is the "
                         "ETTR's fault-free step).")  # fmt: skip
    ap.add_argument("--references", type=int, choices=(1, 2), default=2,
                    help="Fault-free reference runs: 1, before the soaks; 2, one before and one after. The "
                         "fault-free step is their mean, and each soak's ETTR against either is printed: "
                         "on 2 cores two runs of the same job differ by up to 20%% a step (BENCHMARKS "
                         "section 5), so the spread is the figure's error bar.")  # fmt: skip
    args = ap.parse_args(argv)
    if args.trainer_kills:
        return trainer_paths(args.trainer_kills, args.out_dir, args.world, args.model == "100m", args.strategy)
    if args.rollout_kills:
        return rollout_paths(args.rollout_kills, args.out_dir)
    if args.reference_steps < REFERENCE_SKIP + 20:
        ap.error(f"--reference-steps must be at least {REFERENCE_SKIP + 20} (the first {REFERENCE_SKIP} are left out)")
    duration = parse_seconds(args.duration)
    steps = args.steps or int(duration * 15)
    mtbfs = [float(x) for x in args.mtbf.split(",") if x.strip()]
    print(machine_line(), flush=True)

    def reference(when: str) -> dict[str, Any]:
        print(f"\nfault-free reference ({when}): the same job, {args.reference_steps} steps, no fault", flush=True)
        ref = soak(1e9, 60, args.seed, args.reference_steps, args.out_dir, args.scenario)
        if ref.get("faults"):
            raise RuntimeError("the fault-free reference run injected a fault")
        step, g = reference_step_s(ref), ref.get("goodput") or {}
        print(f"  -> {ref['job']['phase']}, mean {step:.4f} s a step (commit to commit, past step {REFERENCE_SKIP}); "
              f"its median step_seconds {g.get('fault_free_step_s')}, its own ETTR by the median {g.get('ettr')}",
              flush=True)  # fmt: skip
        return {"when": when, "mean_step_s": round(step, 5), "run_dir": ref.get("run_dir"), "goodput": g}

    refs = [reference("before the soaks")]
    runs: dict[str, list[dict[str, Any]]] = {f"{m:g}": [] for m in mtbfs}
    fulls: list[tuple[dict[str, Any], dict[str, Any]]] = []  # (condensed, full report) of every soak
    for r in range(args.repeats):
        for m in mtbfs:
            print(f"\nsoak: mtbf {m:g} s, {duration:g} s of faults, seed {args.seed + r}, {steps} steps", flush=True)
            full = soak(m, duration, args.seed + r, steps, args.out_dir, args.scenario)
            rep = condense(full)
            rep["ettr_vs_reference"] = ettr_vs_reference(full, refs[0]["mean_step_s"])
            tail = tail_step_s(full)
            rep["tail_step_s"] = None if tail is None else round(tail, 5)
            rep["ettr_vs_own_tail"] = None if tail is None else ettr_vs_reference(full, tail)
            if tail is not None:  # the speed after each fault, against the tail
                for f, s in zip(rep["faults"], speed_after(full, tail), strict=True):
                    f["speed_after"] = s
            runs[f"{m:g}"].append(rep)
            fulls.append((rep, {"steps": full.get("steps", []), "faults": full.get("faults", [])}))
            g = rep["goodput"] or {}
            print(
                f"  -> {rep['job']['phase']}, {rep['injected']}/{rep['scheduled']} faults injected, "
                f"invariants {'green' if all(i['ok'] for i in rep['invariants']) else 'VIOLATED'}, "
                f"ETTR window vs the reference before {rep['ettr_vs_reference']}, vs its own fault-free tail "
                f"{rep['ettr_vs_own_tail']} (a step {rep['tail_step_s']} s); by the median step "
                f"{g.get('ettr_window')}, training phase {g.get('ettr')}",
                flush=True,
            )
    if args.references == 2:
        refs.append(reference("after the soaks"))
    ref_step = sum(x["mean_step_s"] for x in refs) / len(refs)
    for rep, full in fulls:  # against the references' mean, and against each (the spread: drift and noise)
        rep["ettr_vs_each_reference"] = [ettr_vs_reference(full, x["mean_step_s"]) for x in refs]
        rep["ettr_vs_reference"] = ettr_vs_reference(full, ref_step)

    goodput_rows, mttr_rows = [], []
    for m, reps in runs.items():
        g = [r["goodput"] or {} for r in reps]
        goodput_rows.append([
            f"1 per {m} s", len(reps),
            sum(r["injected"] for r in reps),
            "green" if all(i["ok"] for r in reps for i in r["invariants"]) else "**VIOLATED**",
            fmt([r["ettr_vs_reference"] for r in reps if r.get("ettr_vs_reference") is not None]),
            " / ".join(fmt([x for r in reps if (x := r["ettr_vs_each_reference"][j]) is not None])
                       for j in range(len(refs))),
            fmt([r["ettr_vs_own_tail"] for r in reps if r.get("ettr_vs_own_tail") is not None]),
            fmt([x["ettr_window"] for x in g if x.get("ettr_window") is not None]),
            fmt([x["ettr"] for x in g if x.get("ettr") is not None]),
            fmt([x["fault_free_step_s"] for x in g if x.get("fault_free_step_s")], 3),
            sum((r["lost_work"] or {}).get("steps_replayed", 0) for r in reps),
        ])  # fmt: skip
        kinds = sorted({f["kind"] for r in reps for f in r["faults"] if f["status"] == "injected"})
        for k in kinds:
            fs = [f for r in reps for f in r["faults"] if f["kind"] == k and f["status"] == "injected"]
            cells = [fmt([f[c] for f in fs if f[c] is not None]) for c in FIGS]
            cells.append(fmt([f["speed_after"] for f in fs if f.get("speed_after") is not None]))
            mttr_rows.append([f"1 per {m} s", k, len(fs), *cells])

    each = " and ".join(f"{x['mean_step_s']:.4f} s {x['when']}" for x in refs)
    print(
        f"\nGoodput (ETTR = committed steps x fault-free step / wall; median (min-max) over soaks). The fault-free "
        f"step: the reference runs' mean, {ref_step:.4f} s ({each}); or the soak's own median step_seconds\n"
    )
    print(table(["faults", "soaks", "faults injected", "invariants", "ETTR in fault window vs the fault-free run",
                 "vs each reference (" + " / ".join(x["when"] for x in refs) + ")",
                 f"vs the soak's own fault-free tail (from {TAIL_SETTLE_S:g} s after its last fault)",
                 "ETTR in fault window by the median step", "ETTR training phase",
                 "fault-free step s", "steps replayed"], goodput_rows))  # fmt: skip
    print("\nMTTR per fault kind, seconds after injection, median (min-max) over faults\n")
    print(table(["faults", "kind", "n", "detection", "next commit", "group size restored",
                 f"speed over the {AFTER_S:g} s after (vs the soak's tail)"], mttr_rows))  # fmt: skip
    path = save(
        "recovery",
        {"duration_s": duration, "steps": steps, "mtbf_s": mtbfs, "runs": runs,
         "reference": {"steps": args.reference_steps, "mean_step_s": round(ref_step, 5), "runs": refs},
         "summary": {m: {"ettr_window": summary([r["goodput"]["ettr_window"] for r in reps
                                                  if (r["goodput"] or {}).get("ettr_window") is not None]),
                         "ettr_vs_reference": summary([r["ettr_vs_reference"] for r in reps
                                                       if r.get("ettr_vs_reference") is not None]),
                         "ettr_vs_own_tail": summary([r["ettr_vs_own_tail"] for r in reps
                                                      if r.get("ettr_vs_own_tail") is not None])}
                     for m, reps in runs.items()}},
    )  # fmt: skip
    print(f"\nresults: {path}")
    ok = all(i["ok"] for reps in runs.values() for r in reps for i in r["invariants"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
