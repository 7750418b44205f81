"""Experiment loggers (the spec's ``logging`` section): every committed step's metrics, once.

Runs in the leader, on the commit path only (:class:`~resilient_rl.job.committer.StepCommitter`).
A logger is at-least-once at best: a leader can die between a commit and its log write, and
a deposed one may wake in between. So the log follows the commits: after the fenced commit of
step k lands, the leader writes k; a new leader, at its first commit, reads back the steps the
log already holds and writes every committed step it lacks from ``metrics.jsonl`` (whose line
the leader writes before each commit: see ``controller/steplog.py``), then goes on. Read back
at start and keyed by step, no step is written twice and none is lost; a record torn by a
kill mid-write is not read back, so its step is written again.

TensorBoard (``logging.tensorboard: DIR``, relative to the job's workdir) needs the
``tensorboard`` extra; a job that names it without the package installed fails at its
start with the command to run.
"""

from __future__ import annotations

import glob
import logging
import os
from pathlib import Path
from typing import Any

from controller.election import NotLeader

from .context import JobContext

log = logging.getLogger(__name__)

EXTRA = "pip install 'resilient-rl[tensorboard]'"
TAG = "rrl/"  # every scalar's tag starts with it; reward is written for every step (the read-back key)


def scalars(line: dict[str, Any]) -> dict[str, float]:
    """The scalars of one metrics line: its figures, the staleness of its oldest shard, and
    the trainer's statistics (``train``) under ``train/``."""
    out: dict[str, float] = {}
    for name in ("reward", "loss", "tokens", "step_seconds", "tokens_per_s", "reward_errors"):
        v = line.get(name)
        if isinstance(v, int | float) and not isinstance(v, bool):
            out[TAG + name] = float(v)
    if line.get("versions"):
        out[TAG + "staleness"] = float(int(line["step"]) - min(int(v) for v in line["versions"]))
    for name, v in (line.get("train") or {}).items():
        if isinstance(v, int | float) and not isinstance(v, bool):
            out[f"{TAG}train/{name}"] = float(v)
    return out


class TensorBoardLog:
    """Scalars of committed steps in TensorBoard event files under ``logdir`` (see module doc)."""

    def __init__(self, logdir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError(f"logging.tensorboard needs the tensorboard package: {EXTRA}") from None
        self.logdir = logdir
        logdir.mkdir(parents=True, exist_ok=True)
        self.logged = logged_steps(logdir)
        self.evals = logged_steps(logdir, TAG + "eval/reward")  # evaluation records, by their step
        # one file per leader term; flushed at every step (see write), never on a timer
        self._writer = SummaryWriter(log_dir=str(logdir), flush_secs=10**6, max_queue=10**6)

    def write(self, line: dict[str, Any]) -> None:
        """Step ``line['step']``'s scalars, unless the log holds the step already; flushed."""
        k = int(line["step"])
        if k in self.logged:
            return
        for tag, v in scalars(line).items():
            self._writer.add_scalar(tag, v, k)
        self._writer.flush()
        self.logged.add(k)

    def write_eval(self, record: dict[str, Any]) -> None:
        """An evaluation record's scalars at its step, unless the log holds them already; flushed."""
        k = int(record["step"])
        if k in self.evals:
            return
        for tag, v in eval_scalars(record).items():
            self._writer.add_scalar(tag, v, k)
        self._writer.flush()
        self.evals.add(k)

    def close(self) -> None:
        self._writer.close()


def eval_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The scalars of one evaluation record (``JobRunner._evaluated``), logged at its ``step``."""
    return {
        TAG + "eval/reward": float(record["reward"]),
        f"{TAG}eval/pass_at_{record['k']}": float(record["pass_at_k"]),
    }


def logged_steps(logdir: Path, tag: str = TAG + "reward") -> set[int]:
    """The steps whose ``tag`` (the reward: a step's line) the event files under ``logdir`` hold
    (a torn last record is skipped)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    steps: set[int] = set()
    for f in sorted(glob.glob(os.path.join(str(logdir), "events.out.tfevents.*"))):
        try:
            for ev in EventFileLoader(f).Load():
                if ev.HasField("summary") and any(v.tag == tag for v in ev.summary.value):
                    steps.add(int(ev.step))
        except Exception as e:  # noqa: BLE001 - a damaged file: its unread steps are written again
            log.warning("tensorboard: could not read all of %s (%s); its steps after the damage are written again",
                        f, e)  # fmt: skip
    return steps


class ExperimentLog:
    """The job's loggers, opened at the first commit of this leader (see module doc)."""

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx
        self._tb: TensorBoardLog | None = None
        self._opened = False

    def check(self) -> None:
        """Raise ImportError naming the extra to install when a logger the spec names is missing."""
        if self.ctx.spec.logging.tensorboard is not None:
            try:
                import tensorboard  # noqa: F401
            except ImportError:
                raise ImportError(f"logging.tensorboard needs the tensorboard package: {EXTRA}") from None

    def committed(self, k: int, line: dict[str, Any]) -> None:
        """Step ``k`` is committed, with metrics ``line``: log it (and, the first time, every
        committed step the log lacks). Never raises for the log's own failures: a logger is a
        reader of the job, not part of it; its failure is logged, the step stays committed."""
        try:
            if not self._opened:
                self._open(k)
            if self._tb is not None:
                with self.ctx.write_lock:  # as the metrics line: a stopped or deposed runner writes nothing
                    self.ctx.check_leader()
                    self._tb.write(line)
        except NotLeader:
            raise
        except Exception as e:  # noqa: BLE001 - see docstring
            log.warning("job %s: experiment log of step %d failed: %s", self.ctx.job, k, e)

    def evaluated(self, record: dict[str, Any]) -> None:
        """An evaluation is recorded in the job's state: log it (as ``committed``: after the
        record, never raising for the log's own failures; a new leader back-fills from the state)."""
        try:
            if not self._opened:  # no commit of this leader yet (an eval drained at the end, after a take-over)
                self._open(int(self.ctx.read_state().get("step") or 0))
            if self._tb is not None:
                with self.ctx.write_lock:
                    self.ctx.check_leader()
                    self._tb.write_eval(record)
        except NotLeader:
            raise
        except Exception as e:  # noqa: BLE001 - see committed
            log.warning("job %s: experiment log of the eval at step %s failed: %s", self.ctx.job, record.get("step"), e)

    def _open(self, k: int) -> None:
        from controller import steplog

        self._opened = True
        tb = self.ctx.spec.logging.tensorboard
        if tb is None:
            return
        path = Path(tb) if os.path.isabs(tb) else self.ctx.workdir / tb
        self._tb = TensorBoardLog(path)
        missing = [r for r in steplog.read(self.ctx.workdir / "metrics.jsonl", committed=k)
                   if int(r["step"]) not in self._tb.logged]  # fmt: skip
        for row in missing:
            self._tb.write(row)
        for rec in self.ctx.read_state().get("evals") or []:  # evaluations recorded, not yet logged
            self._tb.write_eval(rec)
        if missing:
            log.info("job %s: tensorboard: wrote %d committed step(s) a previous leader had not", self.ctx.job,
                     len(missing))  # fmt: skip

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
