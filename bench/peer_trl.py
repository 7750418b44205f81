"""Peer comparison: TRL's ``GRPOTrainer`` vs rrl (vLLM engine and HF engine) on the copy task, on the CPU.

.venv/bin/python -m bench peer [--repeats 3] [--max-steps 400] ...     (needs ``pip install -e '.[bench]'``)

All three systems train the same job: ``examples/copy-tiny.yaml`` (the ``make demo`` job). Same tiny random
Qwen2 model (``model.init`` of that file, written once with ``resilient_rl.workers.model_init.make_tiny_model``, which
is what the job does itself), same copy task and prompt order (rrl's stateless sampler, ``prompt_indices``,
gives the prompts of step k; TRL gets them as an unshuffled dataset in that order), 16 prompts x 8 samples
per optimizer step, AdamW at a constant lr 1e-3, grad-norm clip 1.0, temperature 1, at most 8 completion
tokens, KL to the initial model (k3) with coefficient 0.02, group-centred advantages without the std
division (rrl ``normalize_std: false``; TRL ``scale_rewards="none"``), the per-sequence mean of the clipped
surrogate (TRL ``loss_type="grpo"``), one optimizer step per batch (TRL ``num_iterations=1``), float32. The
reward is rrl's own ``CopyTask.reward`` in both. TRL runs with its transformers ``generate`` path (no vLLM),
in a child process of its own; rrl runs the unchanged demo job (2 DDP trainer ranks, 1 rollout worker,
snapshots every 20 steps) on a fresh local platform (etcd, Ray head, controller) per run. The platform's
start-up is not timed (a cluster that is already up); the job's own start-up (actors, engine, model) is.

Measured per run, from the per-step rows (rrl: ``metrics.jsonl``; TRL: a ``TrainerCallback``):

- samples/s: ``(last step - step W) x 16 x 8 / (time of the last row - time of row W)``, W = ``--warmup``
  (5) steps skipped; wall clock between step ends, so every gap between steps counts;
- time to reward 0.5: from the submit (rrl: the ``POST /api/v1/jobs``; TRL: the child process launch) to the
  end of the first step at which the mean of the last ``--window`` (10) step rewards is >= ``--threshold``
  (0.5), each step reward being the mean over its 128 samples; also reported from the start of the first
  step (rrl: first row's time minus its ``step_seconds``; TRL: ``on_step_begin`` of step 1);
- a run stops once the threshold is reached (rrl: ``POST /api/v1/jobs/{job}/cancel``; TRL: the callback
  stops training), or at ``--max-steps`` / the wall cap: then it counts as "not reached".

Runs are interleaved (trl, rrl-vllm, rrl-hf, trl, ...) so that load drifts hit all systems alike; every
figure is the median (min-max) over ``--repeats``. Profile the TRL side with
``.venv/bin/pyinstrument -m bench.peer_trl --trl-child OUT.json --model DIR --max-steps 30``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, ROOT, fmt, job_metrics, local_platform, machine, machine_line, save, summary, table

JOB_FILE = ROOT / "examples" / "copy-tiny.yaml"
SYSTEMS = ("trl", "rrl-vllm", "rrl-hf", "rrl-colocated")  # colocated: the HF engine, `placement: colocated`
INSTALL_HINT = "TRL is not installed: pip install -e '.[bench]'"


def load_job() -> dict[str, Any]:
    """The demo job as a plain dict (the same file ``make demo`` submits)."""
    import yaml

    data: dict[str, Any] = yaml.safe_load(JOB_FILE.read_text())
    return data


def job_shape(job: dict[str, Any]) -> dict[str, Any]:
    """The figures both systems must share, read from the job file (validated by rrl's own spec)."""
    from resilient_rl.spec import JobSpec

    spec = JobSpec.model_validate(job)
    assert spec.model.init is not None, "the peer benchmark needs the job's model.init"
    return {
        "prompts_per_step": spec.prompts_per_step,
        "n": spec.rollout.sampling.n,
        "lr": spec.trainer.lr,
        "max_grad_norm": spec.trainer.max_grad_norm,
        "weight_decay": spec.trainer.weight_decay,
        "kl_coef": spec.algorithm.kl_coef,
        "clip_eps": spec.algorithm.clip_eps,
        "normalize_std": spec.algorithm.normalize_std,
        "temperature": spec.rollout.sampling.temperature,
        "top_p": spec.rollout.sampling.top_p,
        "max_tokens": spec.rollout.sampling.max_tokens,
        "seed": spec.seed,
        "task": spec.task.model_dump(),
        "init": spec.model.init.model_dump(),
        "dtype": spec.model.dtype,
    }


def make_model(folder: Path, job: dict[str, Any]) -> Path:
    """Write the job's tiny model (identical weights: same ``init``, same seed) for the TRL side."""
    from resilient_rl.algo.tasks import VOCAB_CHARS
    from resilient_rl.spec import JobSpec
    from resilient_rl.workers.model_init import make_tiny_model

    init = JobSpec.model_validate(job).model.init
    assert init is not None
    return make_tiny_model(folder, init, VOCAB_CHARS)


# --------------------------------------------------------------------------------------------- figures


def analyse(
    rows: list[dict[str, Any]],
    t_submit: float,
    t_first_start: float | None,
    batch: int,
    *,
    window: int,
    threshold: float,
    warmup: int,
) -> dict[str, Any]:
    """Samples/s and time to the threshold from per-step rows (``step``, ``reward``, ``time`` = step end)."""
    rows = sorted(rows, key=lambda r: int(r["step"]))
    out: dict[str, Any] = {"steps": len(rows), "samples_per_s": None, "reached": False}
    if len(rows) > warmup + 1:
        a, b = rows[warmup], rows[-1]
        dt = float(b["time"]) - float(a["time"])
        if dt > 0:
            out["samples_per_s"] = (int(b["step"]) - int(a["step"])) * batch / dt
            out["steady_steps"] = int(b["step"]) - int(a["step"])
            out["step_seconds_mean"] = dt / (int(b["step"]) - int(a["step"]))
        out.update(median_step_figures(rows, batch, warmup))
    rewards = [float(r["reward"]) for r in rows]
    for i in range(window - 1, len(rows)):
        mean = sum(rewards[i - window + 1 : i + 1]) / window
        if mean >= threshold:
            t = float(rows[i]["time"])
            out.update(reached=True, reached_step=int(rows[i]["step"]), reached_mean=mean)
            out["time_to_threshold_s"] = t - t_submit
            if t_first_start is not None:
                out["time_to_threshold_from_first_step_s"] = t - t_first_start
            break
    if t_first_start is not None:
        out["startup_s"] = t_first_start - t_submit
    if rewards:
        out["final_reward_mean"] = sum(rewards[-window:]) / len(rewards[-window:])
    return out


def median_step_figures(rows: list[dict[str, Any]], batch: int, warmup: int) -> dict[str, Any]:
    """Samples/s at the median step (end-to-end gap between consecutive step ends, after ``warmup``):
    robust to a burst of load from other users of a shared machine, which the wall-clock figure is not."""
    rows = sorted(rows, key=lambda r: int(r["step"]))[warmup:]
    gaps = [
        (float(b["time"]) - float(a["time"])) / (int(b["step"]) - int(a["step"]))
        for a, b in zip(rows, rows[1:], strict=False)
        if int(b["step"]) > int(a["step"])
    ]
    if not gaps:
        return {}
    gap = statistics.median(gaps)
    return {"median_step_gap_s": gap, "samples_per_s_median_step": batch / gap if gap > 0 else None}


# --------------------------------------------------------------------------------------------- rrl


def run_rrl(system: str, label: str, job: dict[str, Any], work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One rrl run of the demo job on a fresh local platform: ``rollout.engine`` vllm or hf, or
    (``colocated``) hf with ``placement: colocated``."""
    from controller.jobs import TERMINAL

    spec = copy.deepcopy(job)
    spec["name"] = label
    spec["rollout"]["engine"] = "hf" if system == "colocated" else system
    if system == "colocated":
        spec["placement"] = "colocated"
    spec["steps"] = args.max_steps
    shape = job_shape(spec)
    batch = shape["prompts_per_step"] * shape["n"]
    home = work / label
    home.mkdir(parents=True, exist_ok=True)
    with local_platform(home, progress=lambda *_: None) as (_data, client):
        t_submit = time.time()
        client.post("/api/v1/jobs", {"spec": spec})
        rows: list[dict[str, Any]] = []
        cancelled = why = None
        last_print = -1
        phase = "PENDING"
        while True:
            rec = client.get(f"/api/v1/jobs/{label}")
            phase = str(rec["phase"])
            metrics = home / "jobs" / label / "metrics.jsonl"
            if metrics.exists():
                rows = job_metrics(home, label)
            res = analyse(rows, t_submit, None, batch, window=args.window, threshold=args.threshold, warmup=0)
            if rows and len(rows) // 25 != last_print:
                last_print = len(rows) // 25
                print(f"    {label}: step {len(rows)} reward(last {args.window}) {res.get('final_reward_mean', 0):.3f}"
                      f" after {time.time() - t_submit:.0f} s", flush=True)  # fmt: skip
            if phase in TERMINAL:
                break
            if cancelled is None and (res["reached"] or time.time() - t_submit > args.rrl_max_seconds):
                why = "reached" if res["reached"] else "wall cap"
                client.post(f"/api/v1/jobs/{label}/cancel", {})
                cancelled = time.time()
            if cancelled is not None and time.time() - cancelled > 120:
                print(f"    {label}: still {phase} 120 s after the cancel; leaving it to the platform's stop")
                break
            time.sleep(0.25)
        if (home / "jobs" / label / "metrics.jsonl").exists():
            rows = job_metrics(home, label)
    if not rows:
        raise RuntimeError(f"{label}: no metrics rows (phase {phase}; logs in {home / 'logs'})")
    first = min(rows, key=lambda r: int(r["step"]))
    t_first = float(first["time"]) - float(first["step_seconds"])
    res = analyse(rows, t_submit, t_first, batch, window=args.window, threshold=args.threshold, warmup=args.warmup)
    res.update(system=f"rrl-{system}", phase=phase, stopped=why or "max steps", t_first_start=t_first,
               rows=[{k: r[k] for k in ("step", "reward", "time", "step_seconds")} for r in rows],
               t_submit=t_submit)  # fmt: skip
    return res


# --------------------------------------------------------------------------------------------- TRL


def trl_child(out: Path, model_dir: Path, max_steps: int, max_seconds: float, window: int, threshold: float) -> int:
    """Train with TRL's GRPOTrainer in this process; write the per-step rows to ``out`` (JSON)."""
    t_start = time.time()
    try:
        import trl
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        print(f"{INSTALL_HINT} ({e})", file=sys.stderr)
        return 3
    import torch

    from resilient_rl.algo.sampler import prompt_indices
    from resilient_rl.algo.tasks import Example, make_task
    from resilient_rl.spec import TaskSpec

    job = load_job()
    shape = job_shape(job)
    per_step, n = shape["prompts_per_step"], shape["n"]
    task = make_task(TaskSpec.model_validate(shape["task"]), shape["seed"])
    # rrl's prompts for steps 0..max_steps-1, in order; TRL must not shuffle them.
    order = [i for s in range(max_steps) for i in prompt_indices(shape["seed"], s, per_step, len(task))]
    rows_in = []
    for i in order:
        ex = task.example(i)
        rows_in.append({"prompt": ex.prompt, "answer": ex.answer, "index": ex.index})
    dataset = Dataset.from_list(rows_in)

    def copy_reward(
        prompts: list[str], completions: list[str], answer: list[str], index: list[int], **_: Any
    ) -> list[float | None]:
        return [task.reward(Example(i, p, a), c).value for p, c, a, i in zip(prompts, completions, answer, index, strict=True)]  # fmt: skip

    dtype = getattr(torch, shape["dtype"])
    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    gen_seconds = [0.0]
    orig_generate = model.generate

    def timed_generate(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return orig_generate(*a, **kw)
        finally:
            gen_seconds[0] += time.perf_counter() - t0

    model.generate = timed_generate

    rows: list[dict[str, Any]] = []
    begin: dict[int, float] = {}
    end: dict[int, float] = {}
    stop = {"why": "max steps"}

    class Recorder(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            begin[state.global_step] = time.time()  # 0-based index of the step about to run

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            end[state.global_step - 1] = time.time()

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
            step = state.global_step - 1
            if not logs or "reward" not in logs or step not in end or any(r["step"] == step for r in rows):
                return
            rows.append({"step": step, "reward": float(logs["reward"]), "time": end[step],
                         "step_seconds": end[step] - begin.get(step, end[step])})  # fmt: skip
            rewards = [r["reward"] for r in rows[-window:]]
            if len(rewards) == window and sum(rewards) / window >= threshold:
                stop["why"] = "reached"
                control.should_training_stop = True
            elif time.time() - t_start > max_seconds:
                stop["why"] = "wall cap"
                control.should_training_stop = True
            if len(rows) % 25 == 0:
                print(f"    trl: step {len(rows)} reward(last {window}) {sum(rewards) / len(rewards):.3f} "
                      f"after {time.time() - t_start:.0f} s", flush=True)  # fmt: skip

    work = Path(tempfile.mkdtemp(prefix="rrl-peer-trl-"))
    config = GRPOConfig(
        output_dir=str(work),
        per_device_train_batch_size=per_step * n,  # one generation batch = one optimizer step = 16 x 8
        gradient_accumulation_steps=1,
        num_generations=n,
        max_steps=max_steps,
        learning_rate=shape["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=shape["weight_decay"],
        max_grad_norm=shape["max_grad_norm"],
        optim="adamw_torch",
        beta=shape["kl_coef"],
        epsilon=shape["clip_eps"],
        num_iterations=1,
        loss_type="grpo",
        scale_rewards="group" if shape["normalize_std"] else "none",
        temperature=shape["temperature"],
        top_p=shape["top_p"],
        top_k=0,
        max_completion_length=shape["max_tokens"],
        use_vllm=False,
        shuffle_dataset=False,
        bf16=False,
        fp16=False,
        use_cpu=True,
        seed=shape["seed"],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[copy_reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Recorder()],
    )
    trainer.remove_callback(PrinterCallback)  # the per-step log dicts (disable_tqdm adds it)
    t_ready = time.time()
    trainer.train()
    first_start = begin.get(0)
    out.write_text(json.dumps({
        "trl_version": trl.__version__, "rows": rows, "t_child_start": t_start, "t_ready": t_ready,
        "t_first_start": first_start, "generate_seconds": gen_seconds[0], "stopped": stop["why"],
        "torch_threads": torch.get_num_threads(),
    }))  # fmt: skip
    return 0


def run_trl(label: str, model_dir: Path, job: dict[str, Any], work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One TRL run in a child process (fresh interpreter, like a fresh job)."""
    shape = job_shape(job)
    batch = shape["prompts_per_step"] * shape["n"]
    out = work / f"{label}.json"
    cmd = [sys.executable, "-m", "bench.peer_trl", "--trl-child", str(out), "--model", str(model_dir),
           "--max-steps", str(args.max_steps), "--trl-max-seconds", str(args.trl_max_seconds),
           "--window", str(args.window), "--threshold", str(args.threshold)]  # fmt: skip
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    t_submit = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=args.trl_max_seconds + 300)
    if proc.returncode:
        raise RuntimeError(f"{label}: the TRL child exited {proc.returncode}")
    data = json.loads(out.read_text())
    rows = data["rows"]
    res = analyse(rows, t_submit, data["t_first_start"], batch, window=args.window, threshold=args.threshold,
                  warmup=args.warmup)  # fmt: skip
    train_s = float(rows[-1]["time"]) - float(data["t_first_start"]) if rows else 0.0
    res.update(system="trl", stopped=data["stopped"], trl_version=data["trl_version"], rows=rows, t_submit=t_submit,
               t_first_start=data["t_first_start"], t_ready=data["t_ready"], t_child_start=data["t_child_start"],
               generate_fraction=data["generate_seconds"] / train_s if train_s > 0 else None,
               torch_threads=data["torch_threads"])  # fmt: skip
    return res


# --------------------------------------------------------------------------------------------- report


def summarise(runs: list[dict[str, Any]], systems: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for s in systems:
        rs = [r for r in runs if r["system"] == s]
        reached = [r for r in rs if r["reached"]]
        out[s] = {
            "runs": len(rs),
            "reached": len(reached),
            "samples_per_s": summary([r["samples_per_s"] for r in rs if r["samples_per_s"] is not None]),
            "samples_per_s_median_step": summary(
                [r["samples_per_s_median_step"] for r in rs if r.get("samples_per_s_median_step")]
            ),
            "time_to_threshold_s": summary([r["time_to_threshold_s"] for r in reached]),
            "time_to_threshold_from_first_step_s": summary([r["time_to_threshold_from_first_step_s"] for r in reached]),
            "steps_to_threshold": summary([r["reached_step"] + 1 for r in reached]),
            "startup_s": summary([r["startup_s"] for r in rs if "startup_s" in r]),
            "step_seconds": summary([r["step_seconds_mean"] for r in rs if "step_seconds_mean" in r]),
        }
        if s == "trl":
            out[s]["generate_fraction"] = summary([r["generate_fraction"] for r in rs if r.get("generate_fraction")])
    return out


def report(summ: dict[str, Any], threshold: float) -> tuple[str, list[str]]:
    """The Markdown table and the target verdicts."""
    base = summ.get("trl")
    t = threshold

    def time_cell(s: dict[str, Any], key: str) -> str:
        if not s["reached"]:
            return f"not reached (0/{s['runs']})"
        cell = fmt(s[key], 0) + " s"
        return cell if s["reached"] == s["runs"] else f"{cell}; not reached in {s['runs'] - s['reached']}/{s['runs']}"

    def ratio(s: dict[str, Any], key: str, unit: str = "x") -> str | None:
        if base is None or s is base or not base[key]["n"] or not s[key]["n"]:
            return None
        return f"{s[key]['median'] / base[key]['median']:.2f}{unit}"

    rows = []
    for name, s in summ.items():
        ratio_t = "-"
        if base and name != "trl" and base["reached"] and s["reached"]:
            ratio_t = f"{s['time_to_threshold_s']['median'] / base['time_to_threshold_s']['median']:.2f}"
        rows.append([
            name, f"{s['runs']}", fmt(s["samples_per_s"], 1), fmt(s["samples_per_s_median_step"], 1),
            time_cell(s, "time_to_threshold_s"), time_cell(s, "time_to_threshold_from_first_step_s"),
            fmt(s["steps_to_threshold"], 0), fmt(s["startup_s"], 0),
            ratio(s, "samples_per_s") or "-", ratio(s, "samples_per_s_median_step") or "-", ratio_t,
        ])  # fmt: skip
    headers = ["system", "runs", "samples/s (wall)", "samples/s (median step)", f"time to reward {t} from submit",
               "... from first step", f"steps to {t}", "start-up s", "samples/s vs TRL (wall)",
               "(median step)", "time to reward / TRL's"]  # fmt: skip
    verdicts = []
    if base:
        for name, s in summ.items():
            if name == "trl":
                continue
            r, r2 = ratio(s, "samples_per_s", ""), ratio(s, "samples_per_s_median_step", "")
            if r is not None:
                verdicts.append(f"{name} samples/s >= 1.5x TRL: {'MET' if float(r) >= 1.5 else 'NOT MET'} "
                                f"({r}x wall clock, {r2 or '-'}x at the median step; medians over runs)")  # fmt: skip
            if s["reached"] and not base["reached"]:
                verdicts.append(f"{name} reaches reward {t} sooner than TRL: MET (TRL never reached it)")
            elif s["reached"] and base["reached"]:
                a, b = s["time_to_threshold_s"]["median"], base["time_to_threshold_s"]["median"]
                verdicts.append(f"{name} reaches reward {t} sooner than TRL: {'MET' if a < b else 'NOT MET'} "
                                f"({a:.0f} s vs {b:.0f} s from submit, medians)")  # fmt: skip
            else:
                verdicts.append(f"{name} reaches reward {t} sooner than TRL: NOT MET ({name} did not reach it)")
    return table(headers, rows), verdicts


def notes(summ: dict[str, Any], runs: list[dict[str, Any]], a: dict[str, Any], repeats: int) -> list[str]:
    """The measured side notes under the table."""
    out = [
        f"Each cell: median (min-max) over {repeats} runs per system, interleaved; time to reward = until the "
        f"{a['window']}-step moving mean of the step reward is >= {a['threshold']}; samples/s (wall) = samples "
        f"of the steps after the first {a['warmup']} / wall time between their ends; samples/s (median step) = "
        f"128 / the median gap between consecutive step ends; a run stops at the threshold (cap "
        f"{a['max_steps']} steps, {float(a['trl_max_seconds']):.0f} s TRL / {float(a['rrl_max_seconds']):.0f} s rrl).",
    ]
    trl_runs = [r for r in runs if r["system"] == "trl"]
    if trl_runs:
        gf = summ["trl"].get("generate_fraction", {})
        out.append(f"TRL {trl_runs[0]['trl_version']} (transformers generate, no vLLM, float32, "
                   f"{trl_runs[0]['torch_threads']} torch threads); share of TRL's training wall time inside "
                   f"`generate`: {fmt(gf, 2)}.")  # fmt: skip
    return out


def write_markdown(path: Path, command: str, mline: str, tbl: str, verdicts: list[str], extra: list[str]) -> None:
    text = [
        "## Peer comparison: TRL GRPOTrainer vs rrl (copy task, CPU)",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {mline}",
        "",
        tbl,
        "",
        "Targets:",
        "",
        *[f"- {v}" for v in verdicts],
        "",
        *extra,
    ]
    path.write_text("\n".join(text).rstrip() + "\n")


# --------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench peer", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="runs per system, interleaved (default 3)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--max-steps", type=int, default=400, help="step cap of every run (default 400)")
    p.add_argument("--threshold", type=float, default=0.5, help="mean reward to reach (default 0.5)")
    p.add_argument("--window", type=int, default=10, help="moving-mean window in steps (default 10)")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of samples/s (default 5)")
    p.add_argument("--trl-max-seconds", type=float, default=720.0, help="wall cap of a TRL run (default 720)")
    p.add_argument("--rrl-max-seconds", type=float, default=720.0, help="wall cap of an rrl run (default 720)")
    p.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a new temporary one)")
    p.add_argument("--no-save", action="store_true", help="do not write bench/results/peer.{json,md}")
    p.add_argument("--from-json", type=Path, default=None,
                   help="re-render the tables of a saved results file (e.g. bench/results/peer.json), no runs")  # fmt: skip
    p.add_argument("--trl-child", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.trl_child is not None:
        return trl_child(args.trl_child, args.model, args.max_steps, args.trl_max_seconds, args.window, args.threshold)

    if args.from_json is not None:
        return rerender(args.from_json)

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if unknown := set(systems) - set(SYSTEMS):
        p.error(f"unknown systems {sorted(unknown)}; choose from {','.join(SYSTEMS)}")
    if "trl" in systems:
        try:
            import trl  # noqa: F401
        except ImportError:
            print(INSTALL_HINT, file=sys.stderr)
            return 3

    mach = machine()
    mline = machine_line(mach)
    print(f"peer: {mline}", flush=True)
    job = load_job()
    shape = job_shape(job)
    print(f"peer: job {JOB_FILE.relative_to(ROOT)}: {shape['prompts_per_step']} prompts x {shape['n']} samples/step, "
          f"lr {shape['lr']}, kl {shape['kl_coef']}, max_tokens {shape['max_tokens']}; {args.repeats} repeats of "
          f"{', '.join(systems)}; cap {args.max_steps} steps", flush=True)  # fmt: skip
    work = args.workdir or Path(tempfile.mkdtemp(prefix="rrl-peer-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = make_model(work / "model", job) if "trl" in systems else None

    runs: list[dict[str, Any]] = []
    t0 = time.monotonic()
    for rep in range(1, args.repeats + 1):
        for system in systems:
            label = f"peer-{system}-{rep}"
            print(f"[{time.monotonic() - t0:5.0f} s] run {rep}/{args.repeats}: {system}", flush=True)
            if system == "trl":
                assert model_dir is not None
                res = run_trl(label, model_dir, job, work, args)
            else:
                res = run_rrl(system.removeprefix("rrl-"), label, job, work, args)
            res["repeat"] = rep
            runs.append(res)
            tts = (
                f"{res['time_to_threshold_s']:.0f} s (step {res['reached_step'] + 1})"
                if res["reached"]
                else "not reached"
            )
            sps = f"{res['samples_per_s']:.1f}" if res["samples_per_s"] else "-"
            print(f"    -> {system}: {sps} samples/s, time to {args.threshold}: {tts}, {res['steps']} steps, "
                  f"stopped: {res['stopped']}", flush=True)  # fmt: skip

    summ = summarise(runs, systems)
    tbl, verdicts = report(summ, args.threshold)
    trl_version = next((r["trl_version"] for r in runs if r.get("trl_version")), None)
    extra = notes(summ, runs, vars(args), args.repeats)
    print()
    print(tbl)
    print()
    for v in verdicts:
        print(f"- {v}")
    print(f"\npeer: {time.monotonic() - t0:.0f} s in all", flush=True)
    if not args.no_save:
        from bench.common import command_line

        path = save("peer", {"shape": shape, "args": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
                             "summary": summ, "verdicts": verdicts, "trl_version": trl_version,
                             "machine_start": mach, "systems": systems})  # fmt: skip
        md = RESULTS / "peer.md"
        write_markdown(md, command_line(), mline, tbl, verdicts, extra)
        print(f"peer: wrote {path.relative_to(ROOT)} and {md.relative_to(ROOT)}")
    return 0


def rerender(path: Path) -> int:
    """Recompute the figures of a saved ``peer.json`` from its per-step rows; rewrite it and ``peer.md``."""
    data = json.loads(path.read_text())
    a = data["args"]
    warmup, batch = int(a["warmup"]), data["shape"]["prompts_per_step"] * data["shape"]["n"]
    runs = data["runs"]
    for r in runs:
        r.update(median_step_figures(r["rows"], batch, warmup))
    systems = data.get("systems") or list(dict.fromkeys(r["system"] for r in runs))
    summ = summarise(runs, systems)
    tbl, verdicts = report(summ, float(a["threshold"]))
    if "machine_start" in data:
        mline = machine_line(data["machine_start"])
    else:
        mline = machine_line(data["machine"]).replace(" at start;", " when the run ended;")
    data.update(summary=summ, verdicts=verdicts)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    md = path.with_suffix(".md")
    write_markdown(md, data["command"], mline, tbl, verdicts, notes(summ, runs, a, int(a["repeats"])))
    print(tbl)
    print()
    for v in verdicts:
        print(f"- {v}")
    print(f"peer: rewrote {path} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
