"""Rewards from an HTTP service (``task.reward: server``): a reward model or a judge behind an endpoint.

One POST per batch of samples::

    {"samples": [{"prompt": "...", "completion": "...", "answer": "..."}, ...]}
    -> {"rewards": [0.0, 1.0, ...]}            (one finite number in [0, 1] per sample, in order)

Each attempt has ``timeout_s``; a timeout, a connection error or a 5xx answer is retried
(``retries`` more times, jittered exponential backoff, tenacity); a 4xx answer is not (the
request itself is wrong). A batch that fails after its tries, or whose answer is not the
shape above, scores 0 for each of its samples with an error naming the server and what went
wrong, as a raising reward function does; a single value out of range or not a number scores
that sample 0. Never raises.

It runs in the rollout worker's killable scorer processes (``reward_pool``), as reward
functions do: a server that accepts the connection and never answers, or a client stuck
anywhere, is cut at the pool's deadline (``RewardServerSpec.batch_deadline_s``), and the step goes on.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import tenacity

from resilient_rl.algo.tasks.base import RewardResult
from resilient_rl.algo.tasks.rewards import checked_value
from resilient_rl.spec import REWARD_BACKOFF_MAX_S


class _Retry(Exception):
    """An attempt that may succeed if tried again (a timeout, no connection, a 5xx)."""


class ServerScorer:
    """Scores batches against ``url`` (see module doc)."""

    def __init__(self, url: str, timeout_s: float, retries: int) -> None:
        self.url, self.timeout_s, self.retries = url, timeout_s, retries
        self._client = httpx.Client(timeout=timeout_s)

    @classmethod
    def from_config(cls, config: str) -> ServerScorer:
        c = json.loads(config)
        return cls(str(c["url"]), float(c["timeout_s"]), int(c["retries"]))

    def _post(self, body: dict[str, Any]) -> Any:
        try:
            r = self._client.post(self.url, json=body)
        except httpx.TimeoutException:
            raise _Retry(f"no answer within {self.timeout_s:g}s") from None
        except httpx.TransportError as e:
            raise _Retry(f"{type(e).__name__}: {e}") from None
        if r.status_code >= 500:
            raise _Retry(f"HTTP {r.status_code}")
        if r.status_code >= 400:
            raise ValueError(f"HTTP {r.status_code} (not retried): {r.text[:200]}")
        return r.json()

    def score(self, calls: list[tuple[str, str, str]]) -> list[RewardResult]:
        body = {"samples": [{"prompt": p, "completion": c, "answer": a} for p, c, a in calls]}
        tries = self.retries + 1
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(_Retry),
            stop=tenacity.stop_after_attempt(tries),
            wait=tenacity.wait_random_exponential(multiplier=0.2, max=REWARD_BACKOFF_MAX_S),
            reraise=True,
        )
        try:
            answer = retrying(self._post, body)
        except _Retry as e:
            return _all_failed(self.url, f"{e} ({tries} tries)", len(calls))
        except Exception as e:  # a 4xx, a body that is not JSON: the same for every sample
            return _all_failed(self.url, f"{type(e).__name__}: {str(e)[:300]}", len(calls))
        rewards = answer.get("rewards") if isinstance(answer, dict) else None
        if not isinstance(rewards, list) or len(rewards) != len(calls):
            got = f"{len(rewards)} rewards" if isinstance(rewards, list) else type(answer).__name__
            return _all_failed(self.url, f'answered {got}, expected {{"rewards": [{len(calls)} numbers]}}', len(calls))
        return [checked_value(v, f"reward server {self.url}") for v in rewards]

    def one(self, prompt: str, completion: str, answer: str) -> float:
        """One sample, as a reward function (``Task.reward`` in-process): raises with the error
        of a failed request, which ``call_reward_fn`` turns into a 0 with the error recorded."""
        (r,) = self.score([(prompt, completion, answer)])
        if r.error is not None:
            raise RuntimeError(r.error)
        return r.value

    def close(self) -> None:
        self._client.close()


def _all_failed(url: str, why: str, n: int) -> list[RewardResult]:
    return [RewardResult(0.0, f"RewardServerError: reward server {url}: {why}")] * n
