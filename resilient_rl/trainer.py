"""The trainer group: M Ray actors forming one torch.distributed group (DDP).

Every rank reads the whole batch B_k from the journal (by reference, digests
verified), computes the GRPO advantages of the global batch, and trains on its
contiguous slice. The loss on a rank is ``sum(per-sequence losses) / global
batch x world size`` so that DDP's gradient *average* equals the gradient of
the global mean: the same math for any world size (world-size invariance is
tested). Rank 0 publishes the new weights to the object store after each step.

A non-finite loss on any rank rejects the step on every rank (all-reduced
flag): no optimizer step is applied and the caller is told why.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist

from checkpoints.backends import PendingSnapshot, SnapshotError, apply_training_state, make_backend, training_state
from checkpoints.journal import Journal, atomic_write
from checkpoints.snapshots import snapshot_dir, write_manifest
from controller.membership import Registration
from controller.store import Store

from .fencing import check_fence
from .grpo import group_advantages, grpo_loss, sequence_logprobs
from .spec import JobSpec

log = logging.getLogger(__name__)


def weights_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over the parameters in name order (bit-exact comparison of weights)."""
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def batch_tensors(samples: list[dict[str, Any]], pad: int) -> dict[str, torch.Tensor]:
    """Right-padded input ids, attention mask and completion mask for a list of samples."""
    seqs = [s["prompt_ids"] + s["token_ids"] for s in samples]
    t = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), t), pad, dtype=torch.long)
    attn = torch.zeros((len(seqs), t), dtype=torch.long)
    comp = torch.zeros((len(seqs), t), dtype=torch.float32)
    for i, (s, seq) in enumerate(zip(samples, seqs, strict=True)):
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        comp[i, len(s["prompt_ids"]) : len(seq)] = 1.0
    return {"input_ids": ids, "attention_mask": attn, "completion_mask": comp}


def _node_id() -> str | None:
    """The Ray node this process runs on (None outside Ray)."""
    try:
        return str(ray.get_runtime_context().get_node_id())
    except Exception:  # not in a Ray worker
        return None


def trainer_actor() -> Any:
    """``TrainerRank`` as a Ray actor class, with the ``io`` concurrency group its snapshot
    waits run in (beside training). Use this, never a bare ``ray.remote(TrainerRank)``."""
    return ray.remote(concurrency_groups={"io": 1})(TrainerRank)


def _disk_note(path: Path) -> str:
    """Free space where a snapshot failed: torch's writers often hide ENOSPC behind other errors."""
    import shutil

    for p in (path, *path.parents):
        if p.exists():
            free = shutil.disk_usage(p).free
            return f" ({free / 1e6:.1f} MB free on its device{': disk full' if free < (1 << 20) else ''})"
    return ""


class StepRejected(Exception):
    """The step was not applied (non-finite loss or gradient); weights are unchanged."""


class TrainerRank:
    """One rank of the trainer group (see module doc)."""

    def __init__(
        self, job: str, rank: int, world: int, spec_json: str, model_dir: str, workdir: str, etcd: str
    ) -> None:
        torch.set_num_threads(max(1, int(os.environ.get("RRL_WORKER_THREADS", "1"))))
        torch.use_deterministic_algorithms(True)
        self.spec = JobSpec.model_validate_json(spec_json)
        self.job, self.rank, self.world = job, rank, world
        self.model_dir = model_dir
        self.journal = Journal(os.path.join(workdir, "journal"))
        self.store = Store(etcd, timeout=2.0, retry_window=30.0)
        self.member = Registration(
            self.store, job, "trainer", str(rank), ttl=self.spec.fault.lease_ttl, world=world, ray_node=_node_id()
        )
        self.step = 0
        self.model: Any = None
        self.backend = make_backend(self.spec.checkpoint.backend)
        self._pending: tuple[PendingSnapshot | str, Path, int, float] | None = None
        self.fence = 0  # newest leader token seen (see check_fence)
        self.last: dict[str, Any] | None = None  # the result of the newest train_step

    def adopt(self, token: int, spec_digest: str) -> dict[str, Any]:
        """A (new) leader takes this rank over: raise the fence, report where the rank is.

        Runs in the default group, so it answers only after a train step in progress
        (sent by the previous leader) has finished: ``step`` is then settled. A
        snapshot the previous leader left in flight is waited for and abandoned (it
        was never committed; its folder is collected as garbage).
        """
        check_fence(self.fence, token, "adopt")
        if spec_digest != self.spec.digest():
            raise ValueError("this rank runs another spec of the job (a leftover of an earlier run)")
        self.fence = token
        if self._pending is not None:
            pending = self._pending[0]
            if not isinstance(pending, str):
                with contextlib.suppress(SnapshotError):
                    pending.wait()
            self._pending = None
        last = None
        if self.last is not None:
            last = {k: v for k, v in self.last.items() if k != "weights"}
        return {"rank": self.rank, "world": self.world, "step": self.step, "pid": os.getpid(), "last": last}

    def address(self) -> tuple[str, int]:
        """Where rank 0 listens for the process group (called on rank 0 only)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return "127.0.0.1", port

    def setup(self, master: tuple[str, int], restore: str | None = None) -> dict[str, Any]:
        """Join the process group, load the initial model, build DDP + optimizer and, with
        ``restore``, load a committed (verified) snapshot: every rank calls it (collective)."""
        from transformers import AutoModelForCausalLM

        backend = self.spec.trainer.backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() and self.spec.trainer.num_gpus > 0 else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master[0]}:{master[1]}",
            rank=self.rank,
            world_size=self.world,
            timeout=timedelta(seconds=120),
        )
        torch.manual_seed(self.spec.seed)
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=getattr(torch, self.spec.model.dtype))
        model.train()
        self.module = model
        self.model = torch.nn.parallel.DistributedDataParallel(model) if self.world > 1 else model
        t = self.spec.trainer
        params = [p for p in model.parameters() if p.requires_grad]
        if t.optimizer == "adamw":
            self.opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
        else:
            self.opt = torch.optim.SGD(params, lr=t.lr, weight_decay=t.weight_decay)
        self.ref_model = None
        if self.spec.algorithm.kl_coef > 0:
            self.ref_model = AutoModelForCausalLM.from_pretrained(
                self.model_dir, dtype=getattr(torch, self.spec.model.dtype)
            )
            self.ref_model.eval()
        self.pad = int(model.config.pad_token_id if model.config.pad_token_id is not None else 0)
        self.step = 0
        if restore is not None:
            self._restore(Path(restore))
        self.member.update(status="ready", step=self.step)
        return {"rank": self.rank, "step": self.step, "digest": self.digest() if self.rank == 0 else None}

    def _restore(self, path: Path) -> None:
        state = training_state(self.module, self.opt)
        self.backend.load(state, path)  # reshards: the snapshot may come from another world size
        apply_training_state(self.module, self.opt, state)
        self.step = int(state["extra"]["step"])
        rng = path / f"rng-rank{self.rank}.pt"
        if not rng.exists():
            rng = path / "rng-rank0.pt"  # a different world size: ranks share rank 0's stream
        torch.set_rng_state(torch.load(rng, weights_only=True))

    # -- snapshots (see checkpoints/) ------------------------------------------

    def snapshot(self, root: str, token: int = 0) -> dict[str, Any]:
        """Start an async snapshot of the state after ``self.step`` steps (collective, at a
        step boundary). Returns once the state is staged; the write goes on in the
        background and :meth:`wait_snapshot` reports its outcome. A write error here (disk
        full while writing the RNG file) is reported the same way, never raised."""
        check_fence(self.fence, token, "snapshot")
        if self._pending is not None:
            raise RuntimeError("a snapshot is already in flight")
        path = snapshot_dir(root, self.step)
        t0 = time.monotonic()
        extra = {"step": self.step, "world": self.world, "spec_digest": self.spec.digest()}
        try:
            buf = io.BytesIO()
            torch.save(torch.get_rng_state(), buf)
            path.mkdir(parents=True, exist_ok=True)
            atomic_write(path / f"rng-rank{self.rank}.pt", buf.getvalue())
            pending: PendingSnapshot | str = self.backend.async_save(training_state(self.module, self.opt, extra), path)
        except (OSError, SnapshotError) as e:
            pending = f"{type(e).__name__}: {e}"
        self._pending = (pending, path, self.step, t0)
        return {"rank": self.rank, "step": self.step, "blocking_s": time.monotonic() - t0}

    @ray.method(concurrency_group="io")
    def wait_snapshot(self) -> dict[str, Any]:
        """Wait for this rank's write (runs beside training). ``ok`` False with the error
        (e.g. disk full) if it failed; the snapshot then never becomes visible."""
        if self._pending is None:
            return {"ok": False, "error": "no snapshot in flight"}
        pending, path, step, t0 = self._pending
        try:
            if isinstance(pending, str):
                return {"ok": False, "rank": self.rank, "step": step, "error": pending + _disk_note(path)}
            pending.wait()
            return {"ok": True, "rank": self.rank, "step": step, "total_s": time.monotonic() - t0}
        except SnapshotError as e:
            return {"ok": False, "rank": self.rank, "step": step, "error": f"{e}{_disk_note(path)}"}
        finally:
            self._pending = None

    @ray.method(concurrency_group="io")
    def commit_snapshot(self, root: str, step: int, meta: dict[str, Any]) -> dict[str, Any]:
        """Rank 0, after every rank's write succeeded: fsync + digest every file and write
        the manifest last. Returns what the leader records in etcd."""
        m = write_manifest(snapshot_dir(root, step), {**meta, "step": step, "world": self.world})
        return {"step": step, "uri": str(m.path), "digest": m.digest, "bytes": m.bytes}

    def publish(self) -> dict[str, Any]:
        """Put the current weights in the object store (policy version = ``self.step``)."""
        return {"step": self.step, "weights": self._put_weights()}

    def _put_weights(self) -> Any:
        """Publish the weights once to the object store; returns the reference.

        The object is put by the job's weight store actor (``rrl:{job}:weights:0``), so
        it is *owned* by an actor that outlives trainer restarts: a reference owned by
        this rank would die with it while rollout workers are still loading it. Without
        a weight store (standalone use) this rank owns it.
        """
        state = self.state_dict()
        try:
            store = ray.get_actor(f"rrl:{self.job}:weights:0", namespace="rrl")
        except ValueError:
            return ray.put(state)
        return ray.get(store.put.remote(self.step, state))[0]

    def digest(self) -> str:
        return weights_digest(self.module.state_dict())

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def train_step(self, step: int, publish: bool = True, token: int = 0) -> dict[str, Any]:
        """Train on the complete journal batch of ``step``; returns metrics.

        Rank 0's result carries ``weights`` (an object-store reference to the new
        state dict, policy version ``step + 1``) when ``publish``. Raises
        :class:`StepRejected` on every rank if any rank saw a non-finite loss.
        """
        check_fence(self.fence, token, f"train step {step}")
        if step != self.step:
            raise RuntimeError(f"rank {self.rank} is at step {self.step}, asked to train step {step}")
        samples = self.journal.read_batch(step)
        # the batch order is (shard, position): deterministic whatever worker made it
        n = self.spec.rollout.sampling.n
        rewards = torch.tensor([s["reward"] for s in samples], dtype=torch.float64).view(-1, n)
        adv = group_advantages(rewards, self.spec.algorithm.normalize_std).view(-1).float()
        total = len(samples)
        per = total // self.world
        lo, hi = self.rank * per, (self.rank + 1) * per
        mine, my_adv = samples[lo:hi], adv[lo:hi]
        self.opt.zero_grad(set_to_none=True)
        mb = self.spec.trainer.micro_batch
        loss_sum = torch.zeros((), dtype=torch.float64)
        stats_acc: dict[str, float] = {}
        chunks = list(range(0, len(mine), mb))
        for ci, start in enumerate(chunks):
            part = mine[start : start + mb]
            bt = batch_tensors(part, self.pad)
            last = ci == len(chunks) - 1
            ctx = self.model.no_sync() if (self.world > 1 and not last) else contextlib.nullcontext()
            with ctx:
                new_lp = sequence_logprobs(self.model, bt["input_ids"], bt["attention_mask"], bt["completion_mask"])
                old_lp = new_lp.detach()  # one update per batch: the behaviour policy is the current one
                ref_lp = None
                if self.ref_model is not None:
                    with torch.no_grad():
                        ref_lp = sequence_logprobs(
                            self.ref_model, bt["input_ids"], bt["attention_mask"], bt["completion_mask"]
                        )
                seq_loss, stats = grpo_loss(
                    new_lp,
                    old_lp,
                    my_adv[start : start + mb],
                    bt["completion_mask"],
                    self.spec.algorithm.clip_eps,
                    self.spec.algorithm.kl_coef,
                    ref_lp,
                )
                loss = seq_loss.sum() * (self.world / total)
                loss.backward()
            loss_sum += seq_loss.detach().double().sum()
            for k, v in stats.items():
                stats_acc[k] = stats_acc.get(k, 0.0) + float(v) * len(part)
        if self.world > 1:  # the global batch's loss, whatever the world size
            dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
        ok = torch.tensor([1.0 if torch.isfinite(loss_sum) else 0.0])
        grad_norm = None
        if self.spec.trainer.max_grad_norm is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.spec.trainer.max_grad_norm)
            if not torch.isfinite(grad_norm):
                ok[0] = 0.0
        if self.world > 1:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item() < 1.0:
            self.opt.zero_grad(set_to_none=True)
            raise StepRejected(f"step {step}: non-finite loss or gradient; step rejected, weights unchanged")
        self.opt.step()
        self.step = step + 1
        self.member.update(step=self.step, version=self.step)
        out: dict[str, Any] = {
            "rank": self.rank,
            "step": step,
            "loss": float(loss_sum) / total,  # mean sequence loss over the global batch
            "reward_mean": float(rewards.mean()),
            "samples": total,
            "grad_norm": None if grad_norm is None else float(grad_norm),
            **{k: v / max(1, len(mine)) for k, v in stats_acc.items()},
        }
        if self.rank == 0 and publish:
            out["weights"] = self._put_weights()
        self.last = out
        return out

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self.member.close()
