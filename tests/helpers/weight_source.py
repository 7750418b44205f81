"""A publisher of weights for the real-Ray test of the weight store's pull
(tests/integration/test_actor_contract_ray.py): the product's ``ObjectStoreTransport`` and
``WeightStore``, with this small actor in the trainer rank's place (no model, no torch
distributed: only the publish half of ``TrainerRank._put_weights`` and its ``export``)."""

from __future__ import annotations

from typing import Any

import ray
import torch

from resilient_rl.workers.transport import ObjectStoreTransport


def weights(version: int, n: int) -> dict[str, torch.Tensor]:
    """``n`` tensors whose values name the version (mixed dtypes, one bfloat16, one scalar)."""
    out = {f"w{i}": torch.full((256, 4), float(version * 100 + i)) for i in range(n)}
    out["half"] = torch.full((3,), float(version), dtype=torch.bfloat16)
    out["count"] = torch.tensor(version, dtype=torch.int64)
    return out


class Publisher:
    def __init__(self, store: Any) -> None:
        self.store = store
        self.transport: ObjectStoreTransport | None = None

    def publish(self, version: int, n: int, per_bucket: int = 2) -> list[Any]:
        w = weights(version, n)
        items = list(w.items())
        buckets = [items[i : i + per_bucket] for i in range(0, len(items), per_bucket)]
        self.transport = ObjectStoreTransport(self.store, ray.get_runtime_context().current_actor)
        return [self.transport.publish(version, buckets)]

    @ray.method(concurrency_group="export")
    def export(self, version: int, index: int) -> tuple[int, Any]:
        assert self.transport is not None
        return self.transport.export(version, index)
