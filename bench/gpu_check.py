"""What of the trainer runs on a GPU, checked where one is lent: ``python bench/gpu_check.py``.

The lent machine has one GPU and its own torch and transformers, but no vLLM, Ray or etcd,
and no network. So this drives the product's trainer core (``resilient_rl.workers.train_core``,
which imports no Ray) and its engines directly, on ``cuda``, and prints one row per check:
PASS / FAIL with its figure, or SKIP with the reason it cannot run there.

``--dry-run`` runs the same checks on the CPU (gloo, world 1) so CI keeps this script from
rotting; on a GPU machine run it without. Exit 1 if any check FAILs. It needs no pydantic:
where ``resilient_rl.spec`` cannot be imported it builds the same spec fields by hand.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python bench/gpu_check.py` from the repository root
    sys.path.insert(0, str(ROOT))


@dataclass
class Init:
    """The tiny model's shape (the fields of ``resilient_rl.spec.TinyModelInit``)."""

    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    seed: int = 0

    def model_dump(self, mode: str = "python") -> dict[str, Any]:
        return dict(self.__dict__)


def make_spec(strategy: str, mixed: str, dtype: str = "float32") -> Any:
    """The job spec the core reads: the product's own when pydantic is there, else the same fields."""
    trainer = {"strategy": strategy, "mixed_precision": mixed, "micro_batch": 4, "lr": 1e-3}
    try:
        from resilient_rl.spec import parse_spec

        return parse_spec({"name": "gpu-check", "model": {"init": {}, "dtype": dtype}, "prompts_per_step": 2,
                           "rollout": {"sampling": {"n": 4}}, "trainer": trainer})  # fmt: skip
    except ImportError:
        t = SimpleNamespace(replicas=1, optimizer="adamw", weight_decay=0.0, max_grad_norm=1.0,
                            reshard_after_forward=True, activation_checkpointing=False, publish_bucket_mb=64,
                            **trainer)  # fmt: skip
        return SimpleNamespace(
            seed=0, model=SimpleNamespace(dtype=dtype), trainer=t,
            rollout=SimpleNamespace(sampling=SimpleNamespace(n=4)),
            algorithm=SimpleNamespace(normalize_std=True, off_policy_correction=True, clip_eps=0.2, kl_coef=0.0),
        )  # fmt: skip


def batch(vocab: int, seed: int = 0) -> list[dict[str, Any]]:
    import random

    rng = random.Random(seed)
    out = []
    for p in range(2):
        prompt = [rng.randrange(3, vocab) for _ in range(5)]
        for i in range(4):
            out.append({"prompt_index": p, "sample": i, "prompt_ids": prompt, "version": 0, "reward": rng.random(),
                        "token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(2, 8))]})  # fmt: skip
    return out


@dataclass
class Report:
    rows: list[tuple[str, str, str]] = field(default_factory=list)

    def run(self, name: str, fn: Callable[[], str]) -> None:
        t0 = time.perf_counter()
        try:
            detail = fn()
            self.rows.append((name, "PASS", f"{detail} ({time.perf_counter() - t0:.2f} s)"))
        except Exception as e:
            traceback.print_exc()
            self.rows.append((name, "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))

    def skip(self, name: str, why: str) -> None:
        self.rows.append((name, "SKIP", why))

    def print(self) -> None:
        w = max(len(r[0]) for r in self.rows)
        print(f"\n| {'check'.ljust(w)} | result | detail |\n|{'-' * (w + 2)}|--------|--------|")
        for name, res, detail in self.rows:
            print(f"| {name.ljust(w)} | {res.ljust(6)} | {detail} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="See the module doc for what runs.")
    ap.add_argument("--dry-run", action="store_true", help="run every check on the CPU (gloo), as CI does")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    on_gpu = not args.dry_run
    if on_gpu and not torch.cuda.is_available():
        print("no CUDA device here: run with --dry-run for the CPU check", file=sys.stderr)
        return 2
    device = "cuda" if on_gpu else "cpu"
    torch.use_deterministic_algorithms(False if on_gpu else True)
    rep = Report()
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0) if on_gpu else 'cpu (dry run)'}")

    def no_ray() -> str:
        import resilient_rl.workers.engines  # noqa: F401
        import resilient_rl.workers.train_core  # noqa: F401
        from checkpoints import backends  # noqa: F401

        heavy = [m for m in ("ray", "vllm", "pyetcd") if m in sys.modules]
        assert not heavy, f"the trainer core imported {heavy}"
        return "trainer core, engines and snapshots import without Ray, vLLM or etcd"

    rep.run("import the trainer core without Ray", no_ray)
    from checkpoints.backends import make_backend
    from resilient_rl.algo.tasks import VOCAB_CHARS
    from resilient_rl.workers.engines import HFEngine, Sampling
    from resilient_rl.workers.model_init import build_vocab, make_tiny_model
    from resilient_rl.workers.train_core import TrainCore

    work = Path(tempfile.mkdtemp(prefix="rrl-gpu-check-"))
    model_dir = str(make_tiny_model(work / "model", Init(), VOCAB_CHARS))  # type: ignore[arg-type]
    vocab = len(build_vocab(VOCAB_CHARS))
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60))
    dist.init_process_group("nccl" if on_gpu else "gloo", store=store, rank=0, world_size=1)
    if on_gpu:
        torch.cuda.set_device(0)
    cores: dict[str, TrainCore] = {}

    def train_step() -> str:
        core = TrainCore(make_spec("ddp", "none"), model_dir, 0, 1, "ddp", device)
        before = core.digest()
        stats = core.train(batch(vocab))
        assert torch.isfinite(torch.tensor(stats["loss"])) and core.digest() != before
        cores["ddp"] = core
        return f"GRPO loss {stats['loss']:.3g}, grad norm {stats['grad_norm']:.3g}, {stats['num_tokens']:.0f} tokens"

    rep.run(f"GRPO train step, world 1, float32 on {device}", train_step)

    def fsdp_bf16() -> str:
        core = TrainCore(make_spec("fsdp", "bf16"), model_dir, 0, 1, "fsdp", device)
        before = core.digest()
        t0 = time.perf_counter()
        losses = [core.train(batch(vocab, s))["loss"] for s in range(2)]
        dt = (time.perf_counter() - t0) / 2
        assert all(torch.isfinite(torch.tensor(x)) for x in losses) and core.digest() != before
        cores["fsdp"] = core
        peak = f", peak {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB" if on_gpu else ""
        return f"2 steps, {dt * 1000:.0f} ms/step{peak}"

    rep.run(f"FSDP2 world 1, bf16 compute + fp32 reduce, on {device}", fsdp_bf16)

    def dcp_reshard() -> str:
        src = cores["fsdp"]
        path = work / "snap"
        make_backend("dcp").async_save(src.training_state({"step": src.step}), path).wait()
        want = src.digest()
        back = {}
        for strategy in ("fsdp", "ddp"):  # sharded -> sharded and sharded -> whole
            core = TrainCore(make_spec(strategy, "bf16" if strategy == "fsdp" else "none"), model_dir, 0, 1,
                             strategy, device)  # fmt: skip
            state = core.training_state()
            make_backend("dcp").load(state, path)
            core.apply_state(state)
            back[strategy] = core.digest() == want and core.step == src.step
        assert all(back.values()), back
        return "restored bit-exact into fsdp and into ddp"

    rep.run(f"DCP save of sharded state + resharded restore, on {device}", dcp_reshard)

    def hf_engine() -> str:
        eng = HFEngine(model_dir, "float32", device)
        outs = eng.generate(["abc", "hello"], [1, 2], Sampling(temperature=1.0, top_p=1.0, max_tokens=8))
        assert all(len(o.token_ids) >= 1 for o in outs)
        # and the published weights go in bucket by bucket (the object-store transport minus Ray)
        pairs = [p for b in cores["ddp"].buckets(1 << 16, reuse=False) for p in b]  # kept: copies
        eng.load_weights(iter(pairs))
        return f"{sum(len(o.token_ids) for o in outs)} tokens sampled; {len(pairs)} tensors loaded from buckets"

    rep.run(f"HF engine generation + bucketed weight load, on {device}", hf_engine)
    rep.skip("weight transport, CUDA path", "not built: the object-store transport is the only one (needs Ray)")
    rep.skip("shadow copy of the trainer state to host memory", "not built yet (sharded-trainer issue, item 4)")
    rep.skip("upstream vLLM engine", "vLLM is not installed on the lent machine")
    rep.skip("NCCL across ranks", "one GPU: world 1 only")
    dist.destroy_process_group()
    rep.print()
    return 1 if any(r[1] == "FAIL" for r in rep.rows) else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
