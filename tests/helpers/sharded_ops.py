"""A small script language for trainer-core runs under ``local_group.run`` (each rank runs it).

``ops`` is a list of tuples, run in order on every rank:

- ``("build", strategy[, trainer_fields[, algorithm_fields]])``: a fresh :class:`TrainCore`
  (``ddp`` or ``fsdp``) from ``model_dir``, with some ``trainer`` / ``algorithm`` fields changed
- ``("train", i)``: one step on ``batches[i]`` (its loss and time kept under ``loss:<strategy>``)
- ``("save", path)`` / ``("load", path)``: a DCP snapshot of the sharded state, written
  synchronously through the product's backend (``load`` reshards)
- ``("shadow", name)`` / ``("unshadow", name)``: this rank's shadow copy of the state, taken
  and loaded in memory (``TrainCore.shadow_state`` / ``load_shadow``), in the wire format the
  weight store keeps (``transport.pack``, then ``unpack``: numpy views of each tensor's bytes)
- ``("record", name)``: rank 0 records the digest and the full weights under ``name``
- ``("buckets", name, nbytes)``: rank 0 records the sizes and names of the publish buckets

Rank 0 returns ``{name: value}``; the others return None.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def script(rank: int, world: int, spec_json: str, model_dir: str, batches: list[list[dict[str, Any]]],
           ops: list[tuple[Any, ...]]) -> dict[str, Any] | None:  # fmt: skip
    import torch

    from checkpoints.backends import make_backend
    from resilient_rl.spec import JobSpec
    from resilient_rl.workers.train_core import TrainCore
    from resilient_rl.workers.transport import pack, unpack

    spec = JobSpec.model_validate_json(spec_json)
    out: dict[str, Any] = {}
    core: TrainCore | None = None
    label = ""
    shadows: dict[str, Any] = {}
    backend = make_backend("dcp")
    for op in ops:
        kind = op[0]
        if kind == "build":
            core = None  # the previous core's memory goes first
            over = op[2] if len(op) > 2 else {}  # trainer fields changed for this core only
            algo = op[3] if len(op) > 3 else {}  # algorithm fields (a JSON mapping), for this core only
            built = spec
            if over or algo:  # through validation: nested sections (trainer.lora) become models
                data = json.loads(spec.to_json())
                data["trainer"].update(over)
                data["algorithm"].update(algo)
                built = JobSpec.model_validate(data)
            core = TrainCore(built, model_dir, rank, world, op[1])
            label = op[1] + "".join(f"+{k}" for k in sorted({**over, **algo}))
        elif kind == "train":
            assert core is not None
            t0 = time.perf_counter()
            stats = core.train(batches[op[1]])
            out.setdefault(f"step_s:{label}", []).append(time.perf_counter() - t0)
            out.setdefault(f"loss:{label}", []).append(stats["loss"])
        elif kind == "save":
            assert core is not None
            backend.async_save(core.training_state({"step": core.step}), Path(op[1])).wait()
        elif kind == "load":
            assert core is not None
            state = core.training_state()
            backend.load(state, Path(op[1]))
            core.apply_state(state)
        elif kind == "shadow":  # this rank's in-memory shadow copy, kept in this process
            assert core is not None
            tensors, tree = core.shadow_state()
            shadows[op[1]] = (dict(unpack(pack(list(tensors.items())))), tree)
        elif kind == "unshadow":
            assert core is not None
            core.load_shadow(*shadows[op[1]])
        elif kind == "record":
            assert core is not None
            digest = core.digest()
            full = core.full_state()
            if rank == 0:
                out[op[1]] = {"digest": digest, "weights": {k: v.clone() for k, v in full.items()}, "step": core.step}
        elif kind == "buckets":
            assert core is not None
            sizes = []
            names = []
            for b in core.buckets(op[2]):
                sizes.append(sum(t.numel() * t.element_size() for _, t in b))
                names.extend(n for n, _ in b)
            if rank == 0:
                out[op[1]] = {"sizes": sizes, "names": names}
        else:
            raise ValueError(f"unknown op {kind!r}")
        del kind
    torch.distributed.barrier()
    return out if rank == 0 else None
