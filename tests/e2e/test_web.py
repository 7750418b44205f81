"""The status page in a real browser, and /metrics, against a running tiny job.

Debian's Chromium, driven headless by Playwright for Python with ``executable_path``
(Playwright never downloads a browser here). `make setup` installs Chromium
(deploy/local/install-chromium.sh); a missing browser fails this test, it never skips.
Screenshots go to ``build/web-screenshots/`` (or ``$RRL_WEB_SCREENSHOTS``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controller import events, jobs, keys
from tests.conftest import REPO, run_rrl
from tests.e2e.conftest import LivePlatform

pytestmark = pytest.mark.slow

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
JOB = "e2e-web"


def chromium() -> str:
    for path in (os.environ.get("RRL_CHROMIUM"), shutil.which("chromium"), shutil.which("chromium-browser")):
        if path and os.path.exists(path):
            return path
    pytest.fail("Chromium is not installed: run `make setup` (deploy/local/install-chromium.sh) or set RRL_CHROMIUM")


def shots_dir() -> Path:
    d = Path(os.environ.get("RRL_WEB_SCREENSHOTS") or REPO / "build" / "web-screenshots")
    d.mkdir(parents=True, exist_ok=True)
    return d


def api_url(platform: LivePlatform) -> str:
    url = platform.data["api"]["controller-0"]
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                return str(url)
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"the controller's HTTP server at {url} does not answer"
        time.sleep(0.5)


def step(platform: LivePlatform) -> int:
    return int(jobs.get(platform.store, JOB).state.get("step", 0))


@pytest.fixture(scope="module")
def running_job(platform: LivePlatform, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A tiny HF-engine job long enough to watch (cancelled at the end)."""
    work = tmp_path_factory.mktemp("web-job")
    platform.submit(
        {
            "name": JOB,
            "model": {"init": {}},
            "task": {"kind": "copy", "num_prompts": 64},
            "rollout": {"replicas": 1, "engine": "hf", "sampling": {"max_tokens": 6, "n": 4}},
            "trainer": {"replicas": 1, "lr": 0.001},
            "prompts_per_step": 4,
            "steps": 5000,
            "seed": 3,
            "checkpoint": {"dir": str(work), "every": 10},
            "eval": {"every": 3, "prompts": 4},  # the reward plot's eval dots
        }
    )
    deadline = time.monotonic() + 300
    while step(platform) < 2:
        rec = jobs.get(platform.store, JOB)
        assert rec.phase not in jobs.TERMINAL, rec.state
        assert time.monotonic() < deadline, "the job did not start stepping"
        time.sleep(0.5)
    try:
        yield JOB
    finally:
        jobs.cancel(platform.store, JOB)
        platform.wait(JOB, timeout=120)


def committed_steps(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}  # raises on a malformed exposition
    for name in ("rrl_job_step_seconds", "rrl_job_rollout_tokens_per_second", "rrl_job_reward", "rrl_workers"):
        assert any(s.labels.get("job") == JOB for s in fams[name].samples), name
    (value,) = [
        s.value
        for s in fams["rrl_job_committed_steps"].samples
        if s.name == "rrl_job_committed_steps_total" and s.labels["job"] == JOB
    ]
    return value


def test_metrics_scraped_during_a_run_parse_and_the_step_counter_increases(
    platform: LivePlatform, running_job: str
) -> None:
    url = api_url(platform)
    first = committed_steps(url)
    assert first >= 2
    deadline = time.monotonic() + 120
    while (later := committed_steps(url)) <= first:
        assert time.monotonic() < deadline, f"rrl_job_committed_steps stayed at {first}"
        time.sleep(1.0)
    assert later > first
    # the goodput gauges of the running job, and the whole exposition as Prometheus's own linter sees it
    text = httpx.get(url + "/metrics", timeout=10).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("rrl_job_ettr", "rrl_job_ettr_last_hour", "rrl_job_goodput_steps_replayed",
                 "rrl_job_goodput_samples_regenerated", "rrl_job_goodput_recovery_seconds"):  # fmt: skip
        (v,) = [s.value for s in fams[name].samples if s.labels.get("job") == JOB]
        assert 0 <= v <= (1 if "ettr" in name else 1e9), (name, v)
    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    r = run_rrl("status", JOB, "--etcd", platform.data["etcd"], env={"RRL_HOME": str(platform.home)})
    # ETTR = steps x median step / wall, capped at 1: a run whose median step is longer than its
    # mean (a few fast steps among evaluated ones) reads 1.000 legitimately, so only its bounds are checked
    m = re.search(r"goodput: ETTR (\d+\.\d{3}) since the first step, (\d+\.\d{3}) over the last hour; "
                  r"(\d+) steps replayed", r.stdout)  # fmt: skip
    assert r.returncode == 0 and m, r.stdout
    assert 0 < float(m[1]) <= 1 and 0 < float(m[2]) <= 1, r.stdout


def test_job_page_live_scale_and_kill_a_worker(platform: LivePlatform, running_job: str) -> None:
    from playwright.sync_api import expect, sync_playwright

    url = api_url(platform)
    token = (platform.home / "token").read_text().strip()
    shots = shots_dir()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1500})
            page.on("dialog", lambda d: d.accept())  # the kill / cancel confirmations
            page.goto(f"{url}/#token={token}")
            expect(page.locator(f'#jobs tr[data-job="{JOB}"]')).to_be_visible()
            page.goto(f"{url}/jobs/{JOB}#token={token}")
            expect(page.locator("#live")).to_contain_text("live", timeout=15_000)
            page.evaluate("window.__notReloaded = true")  # a reload would drop this

            # workers and the step advancing, without a reload
            expect(page.locator("#workers-rollout tbody tr")).to_have_count(1)
            expect(page.locator("#workers-trainer tbody tr")).to_have_count(1)
            expect(page.locator("#leader")).not_to_have_text("none")
            leader = next(c for c in httpx.get(f"{url}/api/v1/controllers", timeout=10).json() if c["leader"])
            expect(page.locator("#leader")).to_contain_text(f"{leader['id']} on {leader['node']} (pid {leader['pid']})")
            s0 = int(page.locator("#step").inner_text())
            page.wait_for_function(f"Number(document.getElementById('step').textContent) >= {s0 + 2}", timeout=120_000)
            assert page.evaluate("window.__notReloaded") is True
            page.screenshot(path=str(shots / "job-running.png"), full_page=True)

            # a worker's captured output, fetched with the token (the logs route needs it)
            page.locator('#workers-rollout tr[data-worker="0"] button.logs').click()
            expect(page.locator("#log-title")).to_contain_text("rollout 0")
            expect(page.locator("#log-view")).to_contain_text("engine up in", timeout=30_000)
            page.click("#log-close")
            expect(page.locator("#log-panel")).to_be_hidden()

            # scale rollout 1 -> 2 from the page: etcd's desired changes, the new worker shows up
            page.fill("#scale-rollout", "2")
            page.click("#do-scale-rollout")
            expect(page.locator("#action-result")).to_contain_text("ok")
            desired = json.loads(platform.store.get(keys.desired(JOB)).value)  # type: ignore[union-attr]
            assert desired["rollout"] == 2
            expect(page.locator("#workers-rollout tbody tr")).to_have_count(2, timeout=180_000)
            assert len(jobs.get(platform.store, JOB).members["rollout"]) == 2
            page.screenshot(path=str(shots / "job-scaled.png"), full_page=True)

            # kill rollout worker 1 from the page: the fault, then the recovery, in the timeline
            victim = jobs.get(platform.store, JOB).members["rollout"]["1"]["pid"]
            page.locator('#workers-rollout tr[data-worker="1"] button.danger').click()
            expect(page.locator("#action-result")).to_contain_text(str(victim))
            fault = page.locator('#timeline tr.fault[data-kind="rollout_fault"]')
            expect(fault.first).to_be_visible(timeout=180_000)
            page.screenshot(path=str(shots / "fault-detected.png"), full_page=True)
            recovery = page.locator("#timeline tr.recovery")
            expect(recovery.first).to_be_visible(timeout=180_000)
            page.screenshot(path=str(shots / "recovery.png"), full_page=True)
            expect(page.locator('#plot-reward line[data-what="fault"]').first).to_be_attached()
            # both markers show, in shapes of their own (a fault and its recovery share a step)
            expect(page.locator('#plot-reward polygon[data-what="fault"]').first).to_be_attached()
            expect(page.locator('#plot-reward circle[data-what="recovery"]').first).to_be_attached()
            expect(page.locator('#plot-reward circle[data-what="eval"]').first).to_be_attached()
            expect(page.locator("#eval-last")).to_contain_text("last eval (v")
            # faults first: the default filter shows no snapshot rows; each fault row says how it was
            # detected, which path recovered it and how long that took
            expect(page.locator('#timeline tr[data-kind="snapshot"]')).to_have_count(0)
            expect(fault.first.locator("td").last).to_contain_text("spare", timeout=60_000)
            expect(fault.first.locator("td").last).to_contain_text("back in")
            page.select_option("#event-filter", "snapshots")  # every snapshot event, folded into one row
            expect(page.locator("#timeline tbody tr")).to_have_count(1)
            snaps = [e for e in events.read(platform.store, JOB, limit=2000) if e["kind"] == "snapshot"]
            assert int(page.locator("#timeline tbody tr").get_attribute("data-count") or 1) >= min(len(snaps), 2)
            page.select_option("#event-filter", "all")
            expect(page.locator('#timeline tr[data-kind="scale"]').first).to_be_visible()
            page.select_option("#event-filter", "faults")
            # the worker timeline: a strip per worker, its states sampled from membership, the fault on it
            expect(page.locator('#strips g[data-worker="rollout/0"] rect').first).to_be_attached()
            expect(page.locator('#strips g[data-worker="trainer/0"] rect[data-state="training"]').first).to_be_attached(
                timeout=60_000)  # fmt: skip
            expect(page.locator('#strips g[data-worker="rollout/1"] rect').first).to_be_attached()
            expect(page.locator('#strips line[data-what="fault"]').first).to_be_attached()
            assert int(page.locator("#failures").inner_text()) >= 1
            assert int(page.locator("#recoveries").inner_text()) >= 1
            assert page.evaluate("window.__notReloaded") is True
            kinds = [e["kind"] for e in events.read(platform.store, JOB, limit=2000)]
            assert "rollout_fault" in kinds
            # the job goes on with a replacement worker
            s1 = step(platform)
            page.wait_for_function(f"Number(document.getElementById('step').textContent) > {s1}", timeout=120_000)
            expect(page.locator("#workers-rollout tbody tr")).to_have_count(2, timeout=120_000)
            page.screenshot(path=str(shots / "recovered.png"), full_page=True)

            # cancel from the page: once the job has ended the page looks it (no live stream, no
            # scale or cancel buttons), and a fresh load of it too
            page.click("#do-cancel")
            expect(page.locator("#phase")).to_have_text("CANCELLED", timeout=120_000)
            expect(page.locator("#live")).to_contain_text("ended: cancelled")
            for button in ("#do-cancel", "#do-scale-rollout", "#do-scale-trainer"):
                expect(page.locator(button)).to_be_hidden()
            expect(page.locator("#workers button.danger")).to_have_count(0)  # no kill on an ended job
            page.goto(f"{url}/jobs/{JOB}#token={token}")
            expect(page.locator("#live")).to_contain_text("ended: cancelled")
            expect(page.locator("#do-cancel")).to_be_hidden()
            page.wait_for_timeout(3000)  # no stream: nothing turns it back to "live" or "reconnecting"
            expect(page.locator("#live")).to_contain_text("ended: cancelled")
            page.screenshot(path=str(shots / "job-ended.png"), full_page=True)
        finally:
            browser.close()
    assert (shots / "recovery.png").stat().st_size > 10_000
