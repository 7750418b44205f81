"""LoRA's costs against full training on the same model: snapshot bytes, shadow-copy bytes,
weight-sync bytes and step time.

.venv/bin/python -m bench lora [--model tiny|100m] [--r 8] [--steps 3]

World 1 on this machine's CPU (no Ray: the product's ``TrainCore`` in this process), the
tiny model (0.3M parameters) or a randomly initialised Qwen2-shape model of ~105M (hidden
768, 14 layers), AdamW, 2 prompts x 4 samples per step. For full training and for LoRA
(``trainer.lora: {r, target_modules: [q_proj, k_proj, v_proj, o_proj]}``) it measures:

- *trainable parameters*;
- *snapshot bytes*: the folder a DCP ``async_save`` of the training state writes after the
  steps (model + optimizer + step: under LoRA the adapters and their optimizer state only);
- *shadow bytes*: the in-memory shadow copy of the state (``TrainCore.shadow_state``);
- *weight-sync bytes*: what a publish hands to the rollout engines (``TrainCore.buckets``:
  the merged weights under LoRA, so the same as full training: loading adapters into vLLM as
  ``LoRARequest``s is not built);
- *step time*: seconds per ``TrainCore.train`` after the first step.

Results go to ``bench/results/lora.json``.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import fmt, machine_line, save, table

BIG = {"hidden_size": 768, "num_layers": 14, "num_heads": 12, "num_kv_heads": 4, "intermediate_size": 2560}


def _batch(vocab: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for p in range(2):
        prompt = [rng.randrange(3, vocab) for _ in range(8)]
        for i in range(4):
            out.append({"prompt_index": p, "sample": i, "prompt_ids": prompt, "version": 0, "reward": rng.random(),
                        "token_ids": [rng.randrange(3, vocab) for _ in range(16)]})  # fmt: skip
    return out


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(spec: Any, model_dir: str, steps: int, snap: Path) -> dict[str, Any]:
    import torch

    from checkpoints.backends import make_backend
    from resilient_rl.workers.train_core import TrainCore

    torch.set_num_threads(2)
    core = TrainCore(spec, model_dir)
    vocab = int(core.module.config.vocab_size) if hasattr(core.module, "config") else 64
    times = []
    for k in range(steps):
        t0 = time.perf_counter()
        core.train(_batch(vocab, k))
        times.append(time.perf_counter() - t0)
    make_backend("dcp").async_save(core.training_state({"step": core.step}), snap).wait()
    shadow, _ = core.shadow_state()
    sync = sum(t.numel() * t.element_size() for b in core.buckets(64 << 20, reuse=False) for _, t in b)
    return {
        "trainable": sum(p.numel() for p in core.module.parameters() if p.requires_grad),
        "params": sum(p.numel() for p in core.module.parameters()),
        "snapshot_bytes": _bytes(snap),
        "shadow_bytes": sum(t.numel() * t.element_size() for t in shadow.values()),
        "sync_bytes": sync,
        "step_s": times[1:] or times,
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench lora", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["tiny", "100m"], default="tiny", help="the model (default tiny)")
    ap.add_argument("--r", type=int, default=8, help="LoRA rank (default 8)")
    ap.add_argument("--steps", type=int, default=3, help="train steps per run (default 3)")
    args = ap.parse_args(argv)
    from resilient_rl.algo.tasks import VOCAB_CHARS
    from resilient_rl.spec import parse_spec
    from resilient_rl.workers.model_init import make_tiny_model

    init = BIG if args.model == "100m" else {}
    base = {"name": "bench-lora", "model": {"init": init}, "prompts_per_step": 2, "rollout": {"sampling": {"n": 4}},
            "trainer": {"micro_batch": 8, "lr": 1e-4}}  # fmt: skip
    print(machine_line(), flush=True)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        spec = parse_spec(base)
        assert spec.model.init is not None
        model_dir = str(make_tiny_model(Path(tmp) / "model", spec.model.init, VOCAB_CHARS))
        for name, trainer in (("full", {}), (f"lora r={args.r}", {"lora": {"r": args.r, "alpha": 2 * args.r}})):
            s = parse_spec({**base, "trainer": {**base["trainer"], **trainer}})
            results[name] = measure(s, model_dir, args.steps, Path(tmp) / name.replace(" ", "-"))
            print(f"{name}: done", flush=True)
    full = results["full"]
    rows = []
    for name, r in results.items():
        rows.append([name, f"{r['trainable']:,} of {r['params']:,}", f"{r['snapshot_bytes']:,}",
                     f"{r['shadow_bytes']:,}", f"{r['sync_bytes']:,}", fmt(r["step_s"], 3),
                     f"{r['snapshot_bytes'] / full['snapshot_bytes']:.3f}"])  # fmt: skip
    print(table(["training", "trainable params", "snapshot bytes", "shadow bytes", "weight-sync bytes", "step s",
                 "snapshot vs full"], rows))  # fmt: skip
    save("lora", {"model": args.model, "r": args.r, "steps": args.steps, "results": results})
    return 0
