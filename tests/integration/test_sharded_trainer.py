"""The trainer's core under DDP and FSDP2, on real gloo process groups (no Ray).

The same journal batches trained at world 1 and 2, DDP and FSDP, give the same weights up
to the reduction order; a sharded (DCP) snapshot restores bit-exactly at another world
size or strategy; publish buckets cover every weight once, at the bucket size.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from resilient_rl.algo.tasks import VOCAB_CHARS
from resilient_rl.spec import parse_spec
from resilient_rl.workers.model_init import build_vocab, make_tiny_model
from tests.helpers import dist_run
from tests.helpers.sharded_ops import script

PROMPTS, N = 3, 3  # 9 samples: 5 / 4 over two ranks, so the uneven split and the empty micro-batch are exercised


def _batches(steps: int, seed: int = 0) -> list[list[dict[str, Any]]]:
    rng = random.Random(seed)
    vocab = len(build_vocab(VOCAB_CHARS))
    out = []
    for _ in range(steps):
        batch = []
        for p in range(PROMPTS):
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 6))]
            for i in range(N):
                batch.append({"prompt_index": p, "sample": i, "prompt_ids": prompt, "version": 0,
                              "token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(1, 8))],
                              "reward": rng.random()})  # fmt: skip
        out.append(batch)
    return out


def _spec(**trainer: Any) -> str:
    return parse_spec({"name": "shard", "model": {"init": {"num_layers": 2}}, "prompts_per_step": PROMPTS,
                       "rollout": {"sampling": {"n": N}},
                       "trainer": {"micro_batch": 2, "lr": 1e-2, **trainer}}).to_json()  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    spec = parse_spec({"name": "shard", "model": {"init": {"num_layers": 2}}})
    assert spec.model.init is not None
    return str(make_tiny_model(tmp_path_factory.mktemp("m") / "model", spec.model.init, VOCAB_CHARS))


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rel: float) -> float:
    """The relative difference of the whole weight vectors, ``|a - b| / |b|`` (asserts ``<= rel``).

    Over the whole model, not per tensor: a tensor whose exact gradient is zero (the key
    projection's bias: softmax ignores a shift shared by all keys) gets a gradient of pure
    rounding noise, which AdamW scales to lr-sized steps whatever the reduction order; it is
    a real difference of the reduction order, not of the math, and per tensor it reads 1e-4."""
    assert sorted(a) == sorted(b)
    diff = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a) ** 0.5
    norm = sum(float(b[k].double().pow(2).sum()) for k in b) ** 0.5
    worst = diff / norm
    assert worst <= rel, f"weights differ by {worst:.3g} relative (> {rel})"
    return worst


@pytest.fixture(scope="module")
def runs(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same three batches at world 1 and 2, DDP then FSDP in the same processes; the
    world-2 FSDP run also writes a sharded snapshot after step 1 and lists its publish buckets."""
    s1 = str(tmp_path_factory.mktemp("snap") / "s1")
    steps = [("train", i) for i in range(3)]
    one = dist_run.run(1, script, _spec(), model_dir, BATCHES,
                       [("build", "ddp"), ("record", "init"), *steps, ("record", "ddp"),
                        ("build", "fsdp"), *steps, ("record", "fsdp")])[0]  # fmt: skip
    two = dist_run.run(2, script, _spec(), model_dir, BATCHES,
                       [("build", "ddp"), *steps, ("record", "ddp"), ("build", "fsdp"), ("record", "init"),
                        ("train", 0), ("save", s1), ("record", "at1"), ("train", 1), ("record", "at2"), ("train", 2),
                        ("record", "fsdp"), ("buckets", "buckets", BUCKET)])[0]  # fmt: skip
    return {"one": one, "two": two, "s1": s1}


BATCHES = _batches(3)
BUCKET = 200_000


def test_fsdp_and_ddp_at_world_1_and_2_train_the_same_weights(runs: dict[str, Any]) -> None:
    one, two = runs["one"], runs["two"]
    ref = one["ddp"]["weights"]
    assert one["init"]["digest"] == two["init"]["digest"]  # the same start, gathered from the shards
    init = one["init"]["weights"]
    assert max(float((ref[k] - init[k]).abs().max()) for k in ref) > 1e-3  # training moved the weights
    assert one["fsdp"]["digest"] == one["ddp"]["digest"]  # world 1: the same arithmetic, bit for bit
    for r in (one, two):
        for s in ("ddp", "fsdp"):
            assert r[s]["step"] == 3, s
            _close(r[s]["weights"], ref, 1e-5)  # world 2: the reduction order differs
            assert r[f"loss:{s}"] == pytest.approx(one["loss:ddp"], rel=1e-5)  # the global batch's loss


def test_sharded_snapshot_restores_at_another_world_size_and_strategy(runs: dict[str, Any], model_dir: str) -> None:
    two, s1 = runs["two"], runs["s1"]
    # world 2 -> 1 (fsdp) and -> ddp: the restored weights are the saved ones, bit for bit
    b = dist_run.run(1, script, _spec(), model_dir, BATCHES,
                     [("build", "fsdp"), ("load", s1), ("record", "r"), ("train", 1), ("record", "next"),
                      ("build", "ddp"), ("load", s1), ("record", "ddp")])[0]  # fmt: skip
    assert b["r"]["digest"] == two["at1"]["digest"] == b["ddp"]["digest"]
    assert b["r"]["step"] == 1
    # the optimizer state came along: the next step matches the uninterrupted run (up to reduction order)
    _close(b["next"]["weights"], two["at2"]["weights"], 1e-5)
    # and back at world 2, fsdp, from the same snapshot: exactly the uninterrupted run
    c = dist_run.run(2, script, _spec(), model_dir, BATCHES,
                     [("build", "fsdp"), ("load", s1), ("train", 1), ("record", "at2")])[0]  # fmt: skip
    assert c["at2"]["digest"] == two["at2"]["digest"]


def test_publish_buckets_cover_every_weight_once_at_the_bucket_size(runs: dict[str, Any]) -> None:
    r = runs["two"]
    sizes, names = r["buckets"]["sizes"], r["buckets"]["names"]
    weights = r["fsdp"]["weights"]
    assert sorted(names) == sorted(weights) and len(names) == len(set(names))
    biggest = max(t.numel() * t.element_size() for t in weights.values())
    assert len(sizes) > 1 and all(s < BUCKET + biggest for s in sizes)
