"""`task.reward: server` against a real HTTP reward service the test starts on 127.0.0.1, through
the rollout worker's killable scorer pool (real child processes; no Ray): batches, retries of
timeouts and 5xx answers, a 4xx not retried, malformed answers, values out of range, and a
server that trickles its answer forever, cut at the pool's deadline."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from resilient_rl.algo.tasks import make_task
from resilient_rl.algo.tasks.reward_pool import RewardPool
from resilient_rl.spec import RewardServerSpec, TaskSpec

pytestmark = pytest.mark.timeout(120)


class Judge:
    """The service: reward 1 when the completion equals the answer. The first sample's completion
    picks a misbehaviour: ``flaky`` answers 500 the first time it is seen, ``down`` always 500,
    ``slow`` sleeps past the client's timeout, ``bad`` 400, ``short`` one reward too few,
    ``high`` a reward of 1.5, ``trickle`` sends its body one byte a second, for ever."""

    def __init__(self) -> None:
        self.requests: list[list[dict[str, Any]]] = []
        self.seen: Counter[str] = Counter()
        self.lock = threading.Lock()
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                samples = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["samples"]
                first = samples[0]["completion"]
                with judge.lock:
                    judge.requests.append(samples)
                    judge.seen[first] += 1
                    n = judge.seen[first]
                if first == "slow":
                    time.sleep(2.0)
                if first == "down" or (first == "flaky" and n == 1):
                    return self._send(500, {"error": "overloaded"})
                if first == "bad":
                    return self._send(400, {"error": "no such model"})
                rewards: list[Any] = [1.0 if s["completion"] == s["answer"] else 0.0 for s in samples]
                if first == "short":
                    rewards = rewards[:-1]
                if first == "high":
                    rewards[0] = 1.5
                if first == "trickle":
                    self.send_response(200)
                    self.send_header("Content-Length", "1000")
                    self.end_headers()
                    try:
                        for _ in range(1000):
                            self.wfile.write(b" ")
                            self.wfile.flush()
                            time.sleep(0.3)  # each read is within the client's timeout: only a deadline ends it
                    except OSError:
                        pass
                    return None
                return self._send(200, {"rewards": rewards})

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def judge() -> Iterator[Judge]:
    j = Judge()
    yield j
    j.server.shutdown()
    j.server.server_close()


def _pool(judge: Judge, **kw: Any) -> RewardPool:
    spec = RewardServerSpec(url=judge.url, **{"timeout_s": 0.5, "retries": 2, "batch_size": 2, **kw})
    return RewardPool.for_server(spec, size=2)


def test_batches_are_scored_in_order_and_transient_failures_retried(judge: Judge) -> None:
    pool = _pool(judge)
    try:
        calls = [("p", "a", "a"), ("p", "b", "x"), ("p", "c", "c"), ("p", "d", "d"), ("p", "e", "y")]
        assert [r.value for r in pool.score(calls)] == [1.0, 0.0, 1.0, 1.0, 0.0]
        assert sorted(len(r) for r in judge.requests) == [1, 2, 2]  # batches of task.reward_server.batch_size
        got = pool.score([("p", "flaky", "flaky"), ("p", "x", "x")])  # a 500, then answered on the retry
        assert [(r.value, r.error) for r in got] == [(1.0, None), (1.0, None)]
        assert judge.seen["flaky"] == 2
    finally:
        pool.close()


def test_failed_batches_score_0_with_an_error_naming_the_server(judge: Judge) -> None:
    pool = _pool(judge, retries=1)
    try:
        down, slow, bad, short, high = (pool.score([("p", w, "a"), ("p", "a", "a")])
                                        for w in ("down", "slow", "bad", "short", "high"))  # fmt: skip
    finally:
        pool.close()
    who = f"RewardServerError: reward server {judge.url}: "
    assert [(r.value, r.error) for r in down] == [(0.0, who + "HTTP 500 (2 tries)")] * 2
    assert judge.seen["down"] == 2
    assert [(r.value, r.error) for r in slow] == [(0.0, who + "no answer within 0.5s (2 tries)")] * 2
    assert all(r.error and r.error.startswith(who + "ValueError: HTTP 400 (not retried)") for r in bad)
    assert judge.seen["bad"] == 1
    assert all(r.error == who + 'answered 1 rewards, expected {"rewards": [2 numbers]}' for r in short)
    assert (
        high[0].value == 0.0 and high[0].error == f"ValueError: reward server {judge.url} returned 1.5, outside [0, 1]"
    )
    assert (high[1].value, high[1].error) == (1.0, None)  # the other sample of that batch keeps its reward


def test_a_server_that_never_finishes_its_answer_is_cut_at_the_deadline(judge: Judge) -> None:
    pool = _pool(judge, retries=0)  # deadline: 0.5 s + 5 s of margin
    try:
        t0 = time.monotonic()
        got = pool.score([("p", "trickle", "a"), ("p", "a", "a"), ("p", "b", "b")])
        took = time.monotonic() - t0
        assert got[0].value == 0.0 and got[0].error is not None
        assert got[0].error.startswith(f"TimeoutError: reward server {judge.url} did not return within 5.5s")
        assert got[0].error == got[1].error  # the whole batch
        assert (got[2].value, got[2].error) == (1.0, None)  # another child scored the rest meanwhile
        assert took < 60 and pool.restarts == 1
        assert pool.score([("p", "c", "c")])[0].value == 1.0  # the replacement child works
    finally:
        pool.close()


def test_the_spec_and_the_in_process_scorer(judge: Judge, tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="reward_server is required when reward is `server`"):
        TaskSpec(kind="jsonl", path="x", reward="server")
    with pytest.raises(ValueError, match="url"):
        RewardServerSpec(url="ftp://x")
    with pytest.raises(ValueError, match="retries"):
        RewardServerSpec(url=judge.url, retries=11)
    spec = TaskSpec(kind="arith", reward="server", reward_server={"url": judge.url})
    with pytest.raises(ValueError, match="not supported for kind 'arith'"):
        make_task(spec, seed=0)
    assert RewardServerSpec(url=judge.url, timeout_s=2, retries=3).batch_deadline_s() == 4 * 2 + 3 * 5 + 5
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "p", "answer": "a"}) + "\n")
    task = make_task(TaskSpec(kind="jsonl", path=str(rows), reward="server",
                              reward_server={"url": judge.url, "retries": 0}), seed=0)  # fmt: skip
    ex = task.example(0)
    assert task.reward(ex, "a").value == 1.0 and task.reward(ex, "b").value == 0.0
    down = task.reward(ex, "down")
    assert down.value == 0.0 and down.error is not None and "HTTP 500 (1 tries)" in down.error
