"""Hot recovery of a DDP trainer group, in real processes over real gloo (no Ray): a rank is
SIGKILLed while its peer waits in the step's all-reduce; the survivor keeps its process and
state, leaves the broken group and forms a new one with a newcomer, which receives the
survivor's model, optimizer, step and RNG; the interrupted step is trained again and the
final weights equal a fault-free run's, bit for bit."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from checkpoints.journal import Journal
from resilient_rl.algo.tasks import VOCAB_CHARS
from resilient_rl.spec import parse_spec
from resilient_rl.workers.model_init import make_tiny_model
from tests.conftest import EtcdServer
from tests.helpers.rank_proc import RankProc, call_all

STEPS = 3
SPEC = {"name": "hot", "model": {"init": {}}, "prompts_per_step": 2, "rollout": {"sampling": {"n": 2}},
        "trainer": {"replicas": 2}, "fault": {"hang_timeout": 20}}  # fmt: skip


def _journal(root: Path) -> None:
    rng = random.Random(7)
    journal = Journal(root / "journal")
    for step in range(STEPS):
        samples = [
            {"prompt_index": i // 2, "sample": i % 2, "prompt_ids": [3, 4, 5],
             "token_ids": [6 + rng.randrange(5) for _ in range(1 + rng.randrange(4))],
             "reward": rng.random(), "version": step}
            for i in range(4)
        ]  # fmt: skip
        journal.commit_batch(step, [journal.write_shard(step, 0, samples, {})])


@pytest.fixture
def job(tmp_path: Path) -> tuple[str, str, str]:
    spec = parse_spec(SPEC)
    model_dir = make_tiny_model(tmp_path / "model", spec.model.init, VOCAB_CHARS)
    _journal(tmp_path)
    return spec.to_json(), str(model_dir), str(tmp_path)


def _group(job: tuple[str, str, str], etcd: EtcdServer, world: int = 2) -> list[RankProc]:
    spec, model_dir, work = job
    ranks = [RankProc("hot", r, world, spec, model_dir, work, etcd.endpoint) for r in range(world)]
    master = ranks[0].call("address")
    call_all(ranks, "setup", master)
    return ranks


def _train(ranks: list[RankProc], step: int) -> None:
    call_all(ranks, "train_step", step, False)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("lost", [1, 0], ids=["rank1_lost", "rank0_lost"])
def test_a_rank_lost_mid_step_is_replaced_hot_and_the_run_stays_exact(
    job: tuple[str, str, str], etcd: EtcdServer, lost: int
) -> None:
    spec, model_dir, work = job
    ref = _group(job, etcd)
    try:
        for step in range(STEPS):
            _train(ref, step)
        want = ref[0].call("digest")
    finally:
        for r in ref:
            r.close()

    ranks = _group(job, etcd)
    newcomer = None
    try:
        first = call_all(ranks, "train_step", 0, False)
        committed = first[0]["sketch"]  # what the commit of step 0 records (TrainCore.sketch)
        assert first[1]["sketch"] == committed  # ddp: one state
        survivor = ranks[1 - lost]
        pid = survivor.pid
        survivor.send("train_step", 1, False)  # waits in the all-reduce for its peer ...
        ranks[lost].kill()  # ... which dies
        err = survivor.error(timeout=60)
        assert "train step" not in err.splitlines()[0] or "Connection" in err  # the collective failed
        status = survivor.call("adopt", 0, parse_spec(SPEC).digest())
        assert status["step"] == 1 and not status["busy"] and status["pid"] == pid  # step 1 was not applied
        assert status["sketch"] == committed  # ... and its state shows it: the committed step's
        newcomer = RankProc("hot", lost, 2, spec, model_dir, work, etcd.endpoint)
        master = survivor.call("address", True)
        survivor.send("reform", master, 0, 1 - lost)
        newcomer.send("setup", master, None, None, 1 - lost)
        back = survivor.result()
        ready = newcomer.result()
        assert back["pid"] == pid and back["step"] == 1 and ready["step"] == 1
        group = [newcomer, survivor] if lost == 0 else [survivor, newcomer]
        prints = [r.call("fingerprint") for r in group]  # a full pass over each rank's state ...
        assert prints[0]["fingerprint"] == prints[1]["fingerprint"]  # model + optimizer + step + RNG
        # ... equal to what the transfer hashed as the state crossed (the driver uses these)
        assert back["fingerprint"] == ready["fingerprint"] == prints[0]["fingerprint"]
        assert newcomer.call("adopt", 0, parse_spec(SPEC).digest())["sketch"] == committed
        for step in range(1, STEPS):  # the interrupted step is trained again, from its journaled batch
            out = call_all(group, "train_step", step, False)
            assert out[0]["sketch"] == out[1]["sketch"] != committed
        got = call_all(group, "digest")[0]
        assert got == want
        assert survivor.pid == pid and survivor.proc.is_alive()
    finally:
        for r in [*ranks, *([newcomer] if newcomer else [])]:
            r.close()
