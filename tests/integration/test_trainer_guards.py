"""Trainer guards: a non-finite loss rejects the step and leaves the weights untouched."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from checkpoints.journal import Journal
from resilient_rl.algo.tasks import VOCAB_CHARS
from resilient_rl.local import free_port
from resilient_rl.spec import parse_spec
from resilient_rl.workers.model_init import build_vocab, make_tiny_model
from resilient_rl.workers.trainer import StepRejected, TrainerRank
from tests.conftest import EtcdServer


def _samples(rewards: list[float]) -> list[dict]:
    return [
        {"prompt_index": 0, "sample": i, "prompt_ids": [3, 4, 5], "token_ids": [6, 7, 1], "reward": r, "version": 0}
        for i, r in enumerate(rewards)
    ]


def test_nan_loss_rejects_step_without_applying_it(
    tmp_path: Path, etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    spec = parse_spec({"name": "guard", "model": {"init": {}}, "prompts_per_step": 1,
                       "rollout": {"sampling": {"n": 4}}})  # fmt: skip
    model_dir = make_tiny_model(tmp_path / "model", spec.model.init, VOCAB_CHARS)
    journal = Journal(tmp_path / "journal")
    journal.commit_batch(0, [journal.write_shard(0, 0, _samples([0.0, 1.0, 0.5, float("nan")]), {})])
    journal.commit_batch(1, [journal.write_shard(1, 0, _samples([0.0, 1.0, 0.5, 0.25]), {})])
    rank = TrainerRank("guard", 0, 1, spec.to_json(), str(model_dir), str(tmp_path), etcd.endpoint)
    try:
        rank.setup(("127.0.0.1", free_port()))
        before = rank.digest()
        with pytest.raises(StepRejected, match="step 0: non-finite"):
            rank.train_step(0, publish=False)
        # the rank says so on its stderr, which its process captures for `rrl logs` (logcapture.py)
        assert any(r.levelname == "ERROR" and "rank 0: step 0: non-finite loss or gradient" in r.getMessage()
                   for r in caplog.records), caplog.text  # fmt: skip
        assert rank.digest() == before and rank.step == 0  # nothing applied
        # a clean batch afterwards trains normally (the guard does not poison the rank)
        rank.journal = journal
        rank.step = 1
        out = rank.train_step(1, publish=False)
        assert out["step"] == 1 and rank.digest() != before
    finally:
        rank.shutdown()


def test_step_statistics_are_token_weighted_whatever_the_micro_batch(tmp_path: Path, etcd: EtcdServer) -> None:
    """clip_frac / ratio_mean / entropy are per-token means over the step's batch (num_tokens its
    token count), as if the batch were one micro-batch: not an average of micro-batch means."""
    import random

    rng = random.Random(3)
    lengths = [1, 5, 2, 7]
    samples = [
        {"prompt_index": i // 2, "sample": i % 2, "prompt_ids": [3, 4, 5], "token_ids": [6 + j % 5 for j in range(n)],
         "logprobs": [rng.uniform(-4.0, -0.5) for _ in range(n)], "reward": float(i % 2), "version": 0}
        for i, n in enumerate(lengths)
    ]  # fmt: skip
    out = {}
    for mb in (1, 8):
        spec = parse_spec({"name": "stats", "model": {"init": {}}, "prompts_per_step": 2,
                           "rollout": {"sampling": {"n": 2}}, "trainer": {"micro_batch": mb},
                           "algorithm": {"off_policy_correction": True, "clip_eps": 0.2}})  # fmt: skip
        model_dir = make_tiny_model(tmp_path / "model", spec.model.init, VOCAB_CHARS)
        work = tmp_path / f"mb{mb}"
        journal = Journal(work / "journal")
        journal.commit_batch(1, [journal.write_shard(1, 0, samples, {})])
        rank = TrainerRank("stats", 0, 1, spec.to_json(), str(model_dir), str(work), etcd.endpoint)
        try:
            rank.setup(("127.0.0.1", free_port()))
            rank.step = 1  # samples of policy v0 trained at step 1: off-policy, their ratios differ from 1
            out[mb] = rank.train_step(1, publish=False)
        finally:
            rank.shutdown()
    assert out[1]["num_tokens"] == out[8]["num_tokens"] == sum(lengths)
    for k in ("ratio_mean", "clip_frac", "entropy"):
        assert out[1][k] == pytest.approx(out[8][k], rel=1e-6), k
    assert (
        out[8]["ratio_mean"] != pytest.approx(1.0) and 0.0 < out[8]["clip_frac"] < 1.0
    )  # the check can see a difference
    # the policy's mean per-token entropy: positive, at most that of a uniform next-token distribution
    assert 0.0 < out[8]["entropy"] <= math.log(len(build_vocab(VOCAB_CHARS))) + 1e-6


def test_rank_zero_holds_its_rendezvous_port_from_address_to_setup(tmp_path: Path, etcd: EtcdServer) -> None:
    """address() opens the process group's store and keeps its port: nobody can take the port
    between the answer and the group's forming (a free port found, closed and bound again
    later can be), and setup forms the group on that same store."""
    import socket

    spec = parse_spec({"name": "rdv", "model": {"init": {}}})
    model_dir = make_tiny_model(tmp_path / "model", spec.model.init, VOCAB_CHARS)
    rank = TrainerRank("rdv", 0, 1, spec.to_json(), str(model_dir), str(tmp_path), etcd.endpoint)
    try:
        host, port = rank.address()
        assert host == "127.0.0.1" and port > 0  # the node's IP (no Ray here: loopback)
        with socket.socket() as s, pytest.raises(OSError):
            s.bind(("127.0.0.1", port))  # still held
        assert rank.address() == (host, port)  # asked again: the same store
        out = rank.setup((host, port))
        assert out["step"] == 0
        import torch.distributed as dist

        assert dist.is_initialized() and dist.get_world_size() == 1
    finally:
        rank.shutdown()
