"""Long-tail rollouts: step time with shard-level work vs prompt-group-level work stealing, and
what a rollout kill costs in generation when finished groups are kept.

.venv/bin/python -m bench balance [--steps 16] [--slow-s 1.0] [--fast-s 0.1] [--straggler 2.0] [--no-kill]

One platform, the tiny HF-engine job on a jsonl task of 64 prompts, 16 prompts x 2 samples a
step, 2 rollout workers, 1 trainer rank, on-policy. The task's reward (``long_tail`` below)
takes ``--slow-s`` for one prompt in eight and ``--fast-s`` for the rest (a 10x spread, as
long reasoning responses against short ones; the delay is per sample and the worker's two
reward processes score a group's samples at once). The same job runs three ways, one after
the other in one run:

- *shard*: 2 shards a step, each generated in one pass (what rrl did before streaming);
- *small shards*: 16 shards a step of one prompt group each (the balance small units give);
- *stealing*: 2 shards a step, ``groups_per_pass: 1``: an idle worker helps with the other
  worker's shard, both taking groups longest expected first (``rollout.longest_first``, the
  default: each prompt's seconds the last time it was generated, so from the second epoch, the
  fifth step, on);
- *stealing, prompt order*: the same with ``longest_first: false``: the owner in prompt order,
  the helper from the shard's end.

Figures: seconds per step (the mean gap between consecutive commits, from the metrics lines,
the first two steps left out: the long tail is in the mean, a step whose slow prompts fell in
one shard; the median is shown too) and the ratio of the means to *shard*; and how many groups
a helper journaled.

Then (unless ``--straggler 1``) *shard* and both *stealing* runs once more with rollout worker 1 a
straggler: every reward it scores takes ``--straggler`` times as long (a slower node, a noisy
neighbour: the barrier of verl #2445). The bench writes worker 1's pid to a file once it has
joined; the reward function (``long_tail``) stretches its sleep when its parent (the worker
that runs its scorer process) is that pid. The first two steps, before the file is written,
are left out of the figures as always.

Then (unless ``--no-kill``) the *stealing* job once more with one SIGKILL of a rollout worker
once it has journaled 3 of the 8 groups of its shard: the generation time lost is the time from its
newest journaled group to the kill (the work in flight); with shard-level journaling it would
have been the whole time since the shard began. Both are reported.

Results go to ``bench/results/balance.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import job_metrics, local_platform, machine_line, save, table

SLOW_EVERY = 8


def long_tail(prompt: str, completion: str, answer: str) -> float:
    """The benchmark's reward: sleeps the seconds the row's ``answer`` says (``slow:0.4:i:FILE``),
    times the factor FILE names for the pid of this scorer's worker (``PID FACTOR`` lines: the
    straggler runs), if any."""
    _, seconds, _, straggler = answer.split(":", 3)
    delay = float(seconds)
    try:
        for line in Path(straggler).read_text().splitlines():
            pid, factor = line.split()
            if int(pid) == os.getppid():
                delay *= float(factor)
    except (OSError, ValueError):
        pass  # no straggler in this run
    time.sleep(delay)
    return float(len(completion) % 2)


def _rows(path: Path, slow_s: float, fast_s: float, straggler: Path) -> None:
    with path.open("w") as f:
        for i in range(64):
            speed = f"slow:{slow_s}" if i % SLOW_EVERY == 0 else f"fast:{fast_s}"
            answer = f"{speed}:{i}:{straggler}"
            f.write(json.dumps({"prompt": f"{i % 10}{(i // 10) % 10}:", "answer": answer}) + "\n")


def _spec(name: str, rows: Path, steps: int, **rollout: Any) -> dict[str, Any]:
    return {
        "name": name, "model": {"init": {}}, "steps": steps, "prompts_per_step": 16, "seed": 1,
        "task": {"kind": "jsonl", "path": str(rows), "reward": "function",
                 "reward_fn": "bench.rollout_balance:long_tail", "reward_workers": 2},
        "rollout": {"replicas": 2, "engine": "hf", "spares": 0, "sampling": {"max_tokens": 6, "n": 2}, **rollout},
        "trainer": {"replicas": 1, "spares": 0, "lr": 0.001},
        "checkpoint": {"every": 100},  # the job's folder: $RRL_HOME/jobs/<name>
    }  # fmt: skip


def _step_seconds(home: Path, name: str) -> list[float]:
    times = [float(m["time"]) for m in job_metrics(home, name)]
    return [b - a for a, b in zip(times, times[1:], strict=False)][1:]  # the first gaps hold start-up


def _stolen(home: Path, name: str) -> tuple[int, int]:
    """(groups journaled by a helper, all groups) over the job's batches, from the shard files' meta."""
    from checkpoints.journal import Journal

    j = Journal(home / "jobs" / name / "journal")
    stolen = total = 0
    k = 0
    while (refs := j.batch(k)) is not None:
        for r in refs:
            meta = j.read_shard(r)["meta"]
            total += len(meta["groups"])
            stolen += sum(w != meta["worker"] for w, _ in meta["groups"])
        k += 1
    return stolen, total


def _kill_one(store: Any, job: str, home: Path, out: dict[str, Any], stop: threading.Event) -> None:
    """SIGKILL rollout worker 0 as soon as it has journaled a group of a shard it owns (a parts folder
    with at least one group); records the kill time, the newest group's time and the shard's start."""
    from controller import jobs

    journal = home / "jobs" / job / "journal"
    while not stop.is_set():
        for d in sorted(journal.glob("step-*/parts-0000")):
            try:  # the groups worker 0 journaled there, oldest first
                groups = sorted((f.stat().st_mtime, f) for f in d.glob("g-*.json")
                                if json.loads(json.loads(f.read_bytes())["body"])["worker"] == 0)  # fmt: skip
            except (OSError, ValueError, KeyError):
                continue
            if len(groups) < 3:  # mid-shard: some of its 8 groups done, the rest to come
                continue
            newest = groups[-1][0]
            info = jobs.get(store, job).members.get("rollout", {}).get("0")
            step = int(d.parent.name.split("-")[1])
            if not info or info.get("status") != "busy" or (info.get("step"), info.get("shard")) != (step, 0):
                continue
            time.sleep(0.05)  # into the next group (a fast one takes 0.1 s): a kill mid-group, not at its start
            os.kill(int(info["pid"]), signal.SIGKILL)
            out.update(killed=time.time(), newest_group=newest, groups=len(groups), shard=str(d),
                       shard_start=float(info["started_at"]))  # fmt: skip
            return
        time.sleep(0.01)


def _mark_straggler(store: Any, job: str, file: Path, factor: float, stop: threading.Event) -> None:
    """Keep ``file`` naming rollout worker 1's pid (and ``factor``) while the job runs."""
    from controller import jobs

    pid = None
    while not stop.is_set():
        try:
            info = jobs.get(store, job).members.get("rollout", {}).get("1")
        except jobs.JobNotFound:  # not submitted yet
            info = None
        if info and info.get("pid") and info["pid"] != pid:
            pid = info["pid"]
            tmp = file.with_suffix(".tmp")
            tmp.write_text(f"{pid} {factor}\n")
            tmp.replace(file)
        time.sleep(0.1)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench balance", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=16, help="steps per job (default 16)")
    ap.add_argument("--slow-s", type=float, default=1.0, help="reward seconds of a slow prompt's sample (default 1.0)")
    ap.add_argument("--fast-s", type=float, default=0.1, help="reward seconds of the others (default 0.1)")
    ap.add_argument(
        "--straggler",
        type=float,
        default=2.0,
        help="reward time factor of rollout worker 1 in the straggler runs (default 2.0; 1 skips them)",
    )
    ap.add_argument("--no-kill", action="store_true", help="skip the rollout-kill run")
    ap.add_argument("--only", choices=["shard", "small shards", "stealing", "stealing, prompt order"],
                    help="run this work unit only")  # fmt: skip
    ap.add_argument(
        "--keep", type=Path, help="run in this folder and keep it (journals, logs); default a temporary one"
    )
    args = ap.parse_args(argv)
    print(machine_line(), flush=True)
    runs = {"shard": {"shards_per_step": 2}, "small shards": {"shards_per_step": 16},
            "stealing": {"shards_per_step": 2, "groups_per_pass": 1},
            "stealing, prompt order": {"shards_per_step": 2, "groups_per_pass": 1, "longest_first": False}}  # fmt: skip
    if args.only:
        runs = {args.only: runs[args.only]}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        tmp = str(args.keep.resolve()) if args.keep else scratch
        Path(tmp).mkdir(parents=True, exist_ok=True)
        home = Path(tmp) / "home"
        rows, straggler = Path(tmp) / "rows.jsonl", Path(tmp) / "straggler"
        _rows(rows, args.slow_s, args.fast_s, straggler)
        plan = [(label, rollout, False) for label, rollout in runs.items()]
        if args.straggler != 1:
            plan += [(f"{label}, straggler", runs[label], True)
                     for label in ("shard", "stealing", "stealing, prompt order") if label in runs]  # fmt: skip
        from controller.store import Store

        with local_platform(home, progress=lambda *_: None) as (data, client):
            from bench.common import run_job

            store = Store(data["etcd"])
            for label, rollout, slow in plan:
                name = "balance-" + label.replace(" ", "-").replace(",", "")
                stop = threading.Event()
                mark = threading.Thread(target=_mark_straggler, args=(store, name, straggler, args.straggler, stop),
                                        daemon=True)  # fmt: skip
                if slow:
                    mark.start()
                try:
                    rec = run_job(client, _spec(name, rows, args.steps, **rollout))
                finally:
                    stop.set()
                    if slow:
                        mark.join(5)
                    straggler.unlink(missing_ok=True)
                secs = _step_seconds(home, name)
                if rec["phase"] != "SUCCEEDED" or not secs:
                    print(f"{label}: {rec['phase']} ({rec.get('state', {}).get('reason')})", file=sys.stderr)
                    return 1
                stolen, total = _stolen(home, name)
                results[label] = {"phase": rec["phase"], "step_s": statistics.mean(secs),
                                  "median_s": statistics.median(secs), "steps_s": secs, "stolen_groups": stolen,
                                  "groups": total}  # fmt: skip
                print(f"{label}: {rec['phase']}, mean step {results[label]['step_s']:.3f}s, {stolen} of {total} "
                      "groups journaled by a helper", flush=True)  # fmt: skip
            if not args.no_kill:
                name = "balance-kill"
                kill: dict[str, Any] = {}
                stop = threading.Event()
                t = threading.Thread(target=_kill_one, args=(store, name, home, kill, stop), daemon=True)
                t.start()
                rec = run_job(client, _spec(name, rows, args.steps, **runs["stealing"]))
                stop.set()
                t.join(5)
                evs = client.get(f"/api/v1/jobs/{name}/events?limit=1000")["events"]
                resumed = [e for e in evs if e.get("kind") == "shard_resumed"]
                kill.update(phase=rec["phase"], resumed=resumed[:1])
                results["kill"] = kill

    def base(label: str) -> float:  # the shard-level run of the same workers
        ref = "shard, straggler" if label.endswith("straggler") else "shard"
        return float(results.get(ref, results[label])["step_s"])

    rows_out = [[label, r["phase"], f"{r['step_s']:.3f}", f"{r['median_s']:.3f}",
                 f"{r['step_s'] / base(label):.2f}", f"{r['stolen_groups']}/{r['groups']}"]
                for label, r in results.items() if label != "kill"]  # fmt: skip
    print(table(["work unit", "phase", "mean s/step", "median s/step", "mean vs shard", "groups by a helper"],
                rows_out))  # fmt: skip
    k = results.get("kill")
    if k and "killed" in k:
        lost, whole = k["killed"] - k["newest_group"], k["killed"] - k["shard_start"]
        share = whole * 1 / (k["groups"] + 1)  # the in-flight pass (1 group) of the groups begun, in time
        print(f"rollout kill with {k['groups']} group(s) journaled: generation lost {lost:.2f}s (the work in flight); "
              f"the in-flight samples' share of the {whole:.2f}s the worker spent on the shard: {share:.2f}s; with "
              f"shard-level journaling all {whole:.2f}s; kept/regenerated: "
              f"{[(e.get('kept'), e.get('regenerated')) for e in k['resumed']]}; job {k['phase']}")  # fmt: skip
        k["lost_s"], k["shard_level_lost_s"], k["in_flight_share_s"] = lost, whole, share
    save(
        "balance" if not args.only else f"balance-{args.only.replace(' ', '-').replace(',', '')}",
        {
            "steps": args.steps,
            "slow_s": args.slow_s,
            "fast_s": args.fast_s,
            "straggler": args.straggler,
            "results": results,
        },
    )
    return 0
