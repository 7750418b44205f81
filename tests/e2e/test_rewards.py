"""User reward functions on the real platform: one that returns inf fails the job naming it (it
used to score 1.0 silently), one that hangs on some samples is timed out per call while the
rollout worker survives and the job goes on. HF engine, one rollout worker, one trainer rank."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from controller import events
from tests.conftest import run_rrl
from tests.e2e.conftest import LivePlatform, journal_samples

pytestmark = pytest.mark.slow

FNS = "tests.unit.reward_fns"


def _spec(name: str, tmp_path: Path, reward_fn: str, **task: Any) -> dict[str, Any]:
    data = tmp_path / "rows.jsonl"
    rows = [json.dumps({"prompt": f"{i}{i}:", "answer": str(i)}) for i in range(10)]
    data.write_text("\n".join([*rows[:5], "{not json", *rows[5:]]) + "\n")  # one bad row, quarantined
    return {
        "name": name,
        "model": {"init": {}},
        "task": {"kind": "jsonl", "path": str(data), "reward": "function", "reward_fn": reward_fn, **task},
        # no warm spares (default 1 each): no worker is lost here, and on 2 cores two processes less
        "rollout": {"replicas": 1, "engine": "hf", "sampling": {"max_tokens": 4, "n": 2}, "spares": 0},
        "trainer": {"replicas": 1, "spares": 0},
        "prompts_per_step": 4,
        "steps": 3,
        "checkpoint": {"dir": str(tmp_path / "w")},
    }


def test_inf_rewards_fail_the_job_naming_the_function(platform: LivePlatform, tmp_path: Path) -> None:
    job = platform.submit(_spec("e2e-inf-reward", tmp_path, f"{FNS}:always_inf", reward_error_window=2))
    rec = platform.wait(job, timeout=300)
    assert rec.phase == "FAILED", rec.state
    reason = rec.state["reason"]
    assert reason.startswith(f"reward function {FNS}:always_inf failed on 16 of 16 samples (100%)"), reason
    assert "returned inf, outside [0, 1]" in reason and "task.max_reward_error_rate 0.5" in reason
    assert rec.state["reward_errors"] == 16 and rec.state["step"] == 2  # two steps seen, then it failed
    evs = [e for e in events.read(platform.store, job, limit=1000) if e["kind"] == "reward_errors"]
    assert len(evs) == 1 and "8 sample(s) scored 0" in evs[0]["message"]  # rate-limited: one for both steps
    r = run_rrl("status", job, "--etcd", platform.data["etcd"])
    assert r.returncode == 0 and "reward errors: 16 samples scored 0" in r.stdout, r.stdout
    _failed_page_links_to_the_logs(platform, job)


def _failed_page_links_to_the_logs(platform: LivePlatform, job: str) -> None:
    """A FAILED job's page: its one-line reason, and a button that shows every worker's output."""
    from playwright.sync_api import expect, sync_playwright

    from tests.e2e.test_web import CHROMIUM_ARGS, api_url, chromium

    token = (platform.home / "token").read_text().strip()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(f"{api_url(platform)}/jobs/{job}#token={token}")
            expect(page.locator("#phase")).to_have_text("FAILED")
            expect(page.locator("#live")).to_contain_text("ended: failed")
            page.click("#reason-logs")
            expect(page.locator("#log-title")).to_contain_text("every worker")
            expect(page.locator("#log-view")).to_contain_text("[rollout-0]", timeout=30_000)
            expect(page.locator("#log-view")).to_contain_text("engine up in")
        finally:
            browser.close()


def test_a_hanging_reward_times_out_per_sample_and_the_worker_survives(platform: LivePlatform, tmp_path: Path) -> None:
    spec = _spec("e2e-hang-reward", tmp_path, f"{FNS}:hangs_sometimes", reward_timeout_s=1.0, max_reward_error_rate=1.0)
    job = platform.submit(spec)
    rec = platform.wait(job, timeout=300)
    assert rec.phase == "SUCCEEDED", rec.state
    samples = [s for k in range(3) for s in journal_samples(tmp_path / "w", k)]
    hung = [s for s in samples if s["reward_error"]]
    assert hung, "no completion hit the hang (the test needs one)"
    for s in hung:
        assert sum(map(ord, s["text"])) % 4 == 0 and s["reward"] == 0.0
        assert s["reward_error"].startswith(f"TimeoutError: reward function {FNS}:hangs_sometimes did not return")
    assert all(s["reward"] == (1.0 if s["text"].strip() else 0.0) for s in samples if not s["reward_error"])
    kinds = [e["kind"] for e in events.read(platform.store, job, limit=1000)]
    assert "reward_errors" in kinds
    assert not {"rollout_hang", "rollout_fault"} & set(kinds), kinds  # the worker was never declared hung
    assert rec.state["reward_errors"] == len(hung)
    # the task's size was computed once, in a Ray task, and recorded (the leader never reads the file)
    assert rec.state["task_size"] == 10 and rec.state["task_quarantined"] == 1
    assert "task_rows_quarantined" in kinds


def test_a_dataset_job_reads_parquet_rows_and_scores_them_with_the_math_reward(
    platform: LivePlatform, tmp_path: Path
) -> None:
    """`task.kind: dataset` end to end: a parquet file the test writes (one empty prompt among
    the rows: quarantined), its columns mapped, the math reward applied in the rollout worker;
    every journaled sample's reward is what the reward gives its row's answer."""
    import datasets

    from resilient_rl.algo.tasks.math_answer import math_reward

    answers = [f"#### {i * 3}" if i % 2 else f"\\boxed{{{i}}}" for i in range(12)]
    rows = [{"q": f"{i}+{i}:", "a": a} for i, a in enumerate(answers)]
    rows.insert(5, {"q": "", "a": "1"})
    datasets.Dataset.from_list(rows).to_parquet(str(path := tmp_path / "rows.parquet"))
    spec = _spec("e2e-dataset", tmp_path, "unused:fn")
    spec["task"] = {"kind": "dataset", "path": str(path), "columns": {"prompt": "q", "answer": "a"}, "reward": "math"}
    job = platform.submit(spec)
    rec = platform.wait(job, timeout=300)
    assert rec.phase == "SUCCEEDED", rec.state
    assert rec.state["task_size"] == 12 and rec.state["task_quarantined"] == 1
    valid = [r for r in rows if r["q"]]
    samples = [s for k in range(3) for s in journal_samples(tmp_path / "w", k)]
    assert len(samples) == 3 * 4 * 2
    for s in samples:
        assert s["reward_error"] is None
        assert s["reward"] == math_reward(valid[s["prompt_index"]]["a"], s["text"]), s


def test_rrl_logs_follows_the_workers_output_with_a_raising_reward_functions_traceback(
    platform: LivePlatform, tmp_path: Path
) -> None:
    """`rrl logs JOB -f --group rollout`, started as the job is submitted: it prints what the
    rollout worker and its reward scorer processes write as they write it (the traceback of a
    raising reward function among it) and ends by itself once the job has."""
    import os
    import subprocess
    import sys

    spec = _spec("e2e-logs", tmp_path, f"{FNS}:always_raises", max_reward_error_rate=1.0)
    job = platform.submit(spec)
    env = {**os.environ, "RRL_HOME": str(platform.home), "COLUMNS": "200"}
    rrl = str(Path(sys.executable).parent / "rrl")
    follow = subprocess.Popen([rrl, "logs", job, "-f", "--group", "rollout", "--etcd", platform.data["etcd"]],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        out, errs = follow.communicate(timeout=300)  # it ends by itself once the job has
    finally:
        follow.kill()
    rec = platform.wait(job, timeout=60)
    assert rec.phase == "SUCCEEDED", rec.state
    assert follow.returncode == 0, errs
    assert "Traceback (most recent call last):" in out, out[-3000:]
    assert f"reward function {FNS}:always_raises raised" in out and "RuntimeError: boom on" in out, out[-3000:]
    # afterwards: the whole group's output, the trainer's too, with their sources and times
    r = run_rrl("logs", job, "--timestamps", "--etcd", platform.data["etcd"], env={"RRL_HOME": str(platform.home)})
    assert r.returncode == 0 and "[rollout-0]" in r.stdout and "RuntimeError: boom on" in r.stdout, r.stdout + r.stderr
    assert run_rrl("logs", job, "--worker", "0", env={"RRL_HOME": str(platform.home)}).returncode == 2
    # the leader's lines about the job, from the local platform's controller logs
    r = run_rrl("logs", job, "--group", "controller", "--tail", "1000", "--etcd", platform.data["etcd"],
                env={"RRL_HOME": str(platform.home)})  # fmt: skip
    assert r.returncode == 0 and f"job {job} step 2 committed" in r.stdout, r.stdout[-2000:] + r.stderr


def test_dynamic_sampling_and_evaluation_with_tensorboard_and_the_replay_matches(
    platform: LivePlatform, tmp_path: Path
) -> None:
    """`algorithm.dynamic_sampling` with `loss_aggregation: token_mean` and DAPO's overlong filter
    and soft punishment, `eval` on a held-out
    task and TensorBoard, real workers: a reward that leaves about half the groups without a
    spread, so steps need extra rounds; every batch in the journal lists its rounds' shards;
    each step trains on at most prompts_per_step groups; the evaluations are recorded and
    logged; `rrl verify`'s replay gives the job's weights (no eval entered the journal)."""
    from checkpoints.journal import Journal
    from resilient_rl.spec import JobSpec
    from resilient_rl.verify import replay_digest

    spec = _spec("e2e-dapo", tmp_path, f"{FNS}:length_parity")
    spec["steps"] = 4
    spec["algorithm"] = {"dynamic_sampling": {"max_extra_prompts": 12}, "loss_aggregation": "token_mean",
                         "overlong": {"filter": True, "buffer_tokens": 2}}  # fmt: skip
    spec["eval"] = {"every": 2, "prompts": 6, "samples": 2, "task": {"kind": "reverse", "num_prompts": 20}}
    spec["logging"] = {"tensorboard": "tb"}
    job = platform.submit(spec)
    rec = platform.wait(job, timeout=300)
    assert rec.phase == "SUCCEEDED", rec.state
    # the evaluations: versions 2 and 4, on the held-out task, in the state, eval.jsonl, status, TensorBoard
    evals = rec.state["evals"]
    assert [e["version"] for e in evals] == [2, 4] and all(e["prompts"] == 6 and e["k"] == 2 for e in evals), evals
    assert all(0 <= e["reward"] <= 1 and 0 <= e["pass_at_k"] <= 1 for e in evals)
    lines = [json.loads(x) for x in (tmp_path / "w" / "eval.jsonl").read_text().splitlines()]
    assert [x["version"] for x in lines] == [2, 4]
    r = run_rrl("status", job, "--etcd", platform.data["etcd"], env={"RRL_HOME": str(platform.home)})
    assert r.returncode == 0 and "eval (policy v4, after step 3): reward" in r.stdout and "pass@2" in r.stdout, r.stdout
    from resilient_rl.job.explog import logged_steps

    assert logged_steps(tmp_path / "w" / "tb", "rrl/eval/reward") == {1, 3}
    assert logged_steps(tmp_path / "w" / "tb") == {0, 1, 2, 3}
    journal = Journal(tmp_path / "w" / "journal")
    rounds = []
    for k in range(4):
        refs = journal.batch(k)
        assert refs is not None and [r.shard for r in refs] == list(range(len(refs)))
        bodies = [journal.read_shard(r) for r in refs]
        rounds.append(max(b["meta"]["round"] for b in bodies) + 1)
        assert sum(len(b["samples"]) for b in bodies) <= (4 + 12) * 2
    assert max(rounds) > 1, f"no step needed an extra round: {rounds}"
    lines = [json.loads(x) for x in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2, 3]
    assert all(1 <= x["train"]["groups_kept"] <= 4 for x in lines), lines
    assert all(0 <= x["train"]["truncated"] <= 8 for x in lines), lines  # responses cut at max_tokens: filtered
    digest = replay_digest(JobSpec.model_validate(rec.spec), 4, platform.data["ray"], platform.data["etcd"])
    assert digest == rec.state["weights_digest"]
