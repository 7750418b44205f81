"""Experiment loggers (the spec's ``logging`` section): every committed step's metrics, once.

Runs in the leader, on the commit path only (:class:`~resilient_rl.job.committer.StepCommitter`).
A logger is at-least-once at best: a leader can die between a commit and its log write, and
a deposed one may wake in between. So the log follows the commits: after the fenced commit of
step k lands, the leader writes k; a new leader, at its first commit, reads back the steps the
log already holds and writes every committed step it lacks from ``metrics.jsonl`` (whose line
the leader writes before each commit: see ``controller/steplog.py``), then goes on. Read back
at start and keyed by step, no step is written twice and none is lost; a record torn by a
kill mid-write is not read back, so its step is written again.

TensorBoard (``logging.tensorboard: DIR``, relative to the job's workdir), MLflow
(``logging.mlflow: {tracking_uri, experiment}``: one run per job, found again by its
``rrl_job`` tag) and Weights & Biases (``logging.wandb: {project, mode}``: the run id is the
job id, resumed) each need their extra; a job that names one without the package installed
fails at its start with the command to run. Evaluation records (``spec.eval``) are logged the
same way, keyed by their step, back-filled from the job's state.
"""

from __future__ import annotations

import glob
import logging
import os
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from controller.election import NotLeader

from .context import JobContext

log = logging.getLogger(__name__)

EXTRAS = {name: f"pip install 'resilient-rl[{name}]'" for name in ("tensorboard", "mlflow", "wandb")}
TAG = "rrl/"  # every scalar's tag starts with it; reward is written for every step (the read-back key)


def scalars(line: dict[str, Any]) -> dict[str, float]:
    """The scalars of one metrics line: its figures, the staleness of its oldest shard, and
    the trainer's statistics (``train``) under ``train/``."""
    out: dict[str, float] = {}
    for name in ("reward", "loss", "tokens", "response_length", "step_seconds", "tokens_per_s", "reward_errors",
                 "faults_recovered"):  # fmt: skip
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
            raise ImportError(f"logging.tensorboard needs the tensorboard package: {EXTRAS['tensorboard']}") from None
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


class MLflowLog:
    """Scalars of committed steps in one MLflow run per job (tag ``rrl_job``, run name the job
    id) of ``experiment`` at ``tracking_uri``; the steps already there are read back (the
    metric history of ``rrl/reward``) and skipped, as TensorBoard's are."""

    def __init__(self, tracking_uri: str, experiment: str, job: str) -> None:
        try:
            from mlflow.entities import Metric
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ImportError(f"logging.mlflow needs the mlflow package: {EXTRAS['mlflow']}") from None
        self._metric = Metric
        # a server that does not answer costs the step loop each call's wait: bounded unless the
        # user asked for more (MLflow's own defaults, 120 s and 7 retries with backoff, are minutes)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        self.client = MlflowClient(tracking_uri=tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        if found is None:
            try:
                exp_id = self.client.create_experiment(experiment)
            except Exception:  # noqa: BLE001 - another leader created it first
                found = self.client.get_experiment_by_name(experiment)
                if found is None:
                    raise
                exp_id = found.experiment_id
        else:
            exp_id = found.experiment_id
        runs = self.client.search_runs([exp_id], filter_string=f"tags.rrl_job = '{job}'",
                                       order_by=["attributes.start_time ASC"], max_results=1)  # fmt: skip
        if runs:
            self.run_id = runs[0].info.run_id
        else:
            self.run_id = self.client.create_run(exp_id, run_name=job, tags={"rrl_job": job}).info.run_id
        self.logged = {int(m.step) for m in self.client.get_metric_history(self.run_id, TAG + "reward")}
        self.evals = {int(m.step) for m in self.client.get_metric_history(self.run_id, TAG + "eval/reward")}

    def _log(self, values: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self._metric(k, v, now, step) for k, v in values.items()])

    def write(self, line: dict[str, Any]) -> None:
        k = int(line["step"])
        if k not in self.logged:
            self._log(scalars(line), k)
            self.logged.add(k)

    def write_eval(self, record: dict[str, Any]) -> None:
        k = int(record["step"])
        if k not in self.evals:
            self._log(eval_scalars(record), k)
            self.evals.add(k)

    def close(self) -> None:
        pass  # the run stays open: the job's next leader logs to it


class WandbLog:
    """Scalars of committed steps in the W&B run whose id is the job id (``resume="allow"``:
    every leader, online or offline, logs to the same run), at W&B's ``step`` = the job's
    step. Known logged: online, the steps before the resumed run's ``step``; offline (and
    online too), what the run files under ``<workdir>/wandb`` hold (read back like
    TensorBoard's). Evaluations are logged in the row of the newest step then, with
    ``rrl/eval/version`` as their own x axis (W&B drops a row below its current step)."""

    def __init__(self, spec: Any, job: str, workdir: Path) -> None:
        try:
            import wandb
        except ImportError:
            raise ImportError(f"logging.wandb needs the wandb package: {EXTRAS['wandb']}") from None
        root = workdir / "wandb"
        self.logged, self.evals = wandb_logged(root, job)
        root.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=spec.project, entity=spec.entity, id=job, name=job, resume="allow",
                              mode=spec.mode, dir=str(workdir), reinit="create_new",
                              settings=wandb.Settings(silent=True, console="off", init_timeout=30))  # fmt: skip
        self.run.define_metric("rrl/eval/*", step_metric="rrl/eval/version")
        self.logged |= set(range(int(self.run.step or 0)))
        last = self.run.summary.get("rrl/eval/version") if spec.mode == "online" else None
        if isinstance(last, int | float):
            self.evals |= set(range(int(last) + 1))
        self.step = max(self.logged, default=-1)  # the newest row: W&B refuses one below it

    def write(self, line: dict[str, Any]) -> None:
        k = int(line["step"])
        if k in self.logged or k < self.step:
            return
        self.run.log(scalars(line), step=k)
        self.logged.add(k)
        self.step = k

    def write_eval(self, record: dict[str, Any]) -> None:
        v = int(record["version"])
        if v in self.evals:
            return
        self.run.log({**eval_scalars(record), "rrl/eval/version": v}, step=max(self.step, 0))
        self.evals.add(v)

    def close(self) -> None:
        self.run.finish()


def wandb_logged(root: Path, job: str) -> tuple[set[int], set[int]]:
    """(steps, eval versions) the W&B run files of run ``job`` under ``root`` hold (``.wandb``
    files: LevelDB log records of W&B's protobuf ``Record``; a torn tail is skipped)."""
    from wandb.proto import wandb_internal_pb2

    steps: set[int] = set()
    evals: set[int] = set()
    for f in sorted(glob.glob(os.path.join(str(root), "*run-*", f"run-{job}.wandb"))):
        try:
            for raw in _leveldb_records(Path(f).read_bytes()):
                rec = wandb_internal_pb2.Record()
                rec.ParseFromString(raw)
                if rec.WhichOneof("record_type") != "history":
                    continue
                items = {i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item}
                if TAG + "reward" in items:
                    steps.add(int(rec.history.step.num))
                if "rrl/eval/version" in items:
                    evals.add(int(float(items["rrl/eval/version"])))
        except Exception as e:  # noqa: BLE001 - a damaged file: what it holds past the damage is written again
            log.warning("wandb: could not read all of %s (%s)", f, e)
    return steps, evals


def _leveldb_records(data: bytes, block: int = 32768) -> Iterator[bytes]:
    """The records of a W&B run file: a 7-byte header (``:W&B``, magic, version), then LevelDB
    log blocks of ``block`` bytes, each record a 7-byte header (crc32c, length, type: full,
    first, middle, last) and its bytes. Stops at a torn record."""
    if data[:4] != b":W&B":
        raise ValueError("not a W&B run file")
    pos, part = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zeros: padding to the block's end
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        if len(chunk) < length:
            return
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            part = chunk
        elif kind == 3:
            part += chunk
        elif kind == 4:
            yield part + chunk
            part = b""


RETRY_S = 60.0  # a logger that failed is left alone this long, then caught up


class _Sink:
    """One logger as the job uses it: the sink (or what builds it, until that succeeds), and
    when to try it again after a failure (then it is caught up from ``metrics.jsonl`` first)."""

    def __init__(self, name: str, build: Callable[[], Any]) -> None:
        self.name, self.build = name, build
        self.sink: Any = None
        self.retry_at = 0.0
        self.behind = True  # catch up before the next write (a fresh sink, or one that failed)

    def failed(self, job: str, what: str, e: BaseException) -> None:
        self.retry_at, self.behind = time.monotonic() + RETRY_S, True
        log.warning("job %s: %s: %s failed (%s); tried again in %.0f s, then caught up", job, self.name, what, e,
                    RETRY_S)  # fmt: skip


class ExperimentLog:
    """The job's loggers, opened at the first commit of this leader (see module doc). A logger
    that cannot be reached (or built) is skipped for a minute at a time, so a tracking server
    that is down costs the step loop at most one failed call a minute (each bounded by the
    client's own timeout), and is caught up from ``metrics.jsonl`` once it answers."""

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx
        self._sinks: list[_Sink] = []  # TensorBoardLog, MLflowLog, WandbLog: logged, evals, write, write_eval, close
        self._opened = False

    def check(self) -> None:
        """Raise ImportError naming the extra to install when a logger the spec names is missing."""
        spec = self.ctx.spec.logging
        for name, module in (("tensorboard", "tensorboard"), ("mlflow", "mlflow"), ("wandb", "wandb")):
            if getattr(spec, name) is not None:
                try:
                    __import__(module)
                except ImportError:
                    raise ImportError(f"logging.{name} needs the {module} package: {EXTRAS[name]}") from None

    def committed(self, k: int, line: dict[str, Any]) -> None:
        """Step ``k`` is committed, with metrics ``line``: log it (and first, for a logger just
        opened or back from a failure, every committed step it lacks). Never raises for the
        log's own failures: a logger is a reader of the job, not part of it; its failure is
        logged, the step stays committed."""
        if not self._opened:
            self._open()
        for s in self._ready(k):
            try:
                with self.ctx.write_lock:  # as the metrics line: a stopped or deposed runner writes nothing
                    self.ctx.check_leader()
                    s.sink.write(line)
            except NotLeader:
                raise
            except Exception as e:  # noqa: BLE001 - see docstring
                s.failed(self.ctx.job, f"the write of step {k}", e)

    def evaluated(self, record: dict[str, Any]) -> None:
        """An evaluation is recorded in the job's state: log it (as ``committed``: after the
        record, never raising for the log's own failures; caught up from the state's ``evals``)."""
        if not self._opened:  # no commit of this leader yet (an eval drained at the end, after a take-over)
            self._open()
        for s in self._ready(int(self.ctx.read_state().get("step") or 0)):
            try:
                with self.ctx.write_lock:
                    self.ctx.check_leader()
                    s.sink.write_eval(record)
            except NotLeader:
                raise
            except Exception as e:  # noqa: BLE001 - see committed
                s.failed(self.ctx.job, f"the write of the eval at step {record.get('step')}", e)

    def _open(self) -> None:
        self._opened = True
        spec, job, workdir = self.ctx.spec.logging, self.ctx.job, self.ctx.workdir
        if spec.tensorboard is not None:
            tb = spec.tensorboard
            path = Path(tb) if os.path.isabs(tb) else workdir / tb
            self._sinks.append(_Sink("tensorboard", lambda: TensorBoardLog(path)))
        if spec.mlflow is not None:
            uri = spec.mlflow.tracking_uri
            if "://" not in uri and not uri.startswith(("file:", "databricks", "sqlite:")):  # a local folder
                folder = (Path(uri) if os.path.isabs(uri) else workdir / uri).resolve()
                folder.mkdir(parents=True, exist_ok=True)
                uri = f"sqlite:///{folder / 'mlflow.db'}"  # MLflow 3 refuses a bare folder store
            experiment = spec.mlflow.experiment
            self._sinks.append(_Sink("mlflow", lambda: MLflowLog(uri, experiment, job)))
        if spec.wandb is not None:
            wb = spec.wandb
            self._sinks.append(_Sink("wandb", lambda: WandbLog(wb, job, workdir)))

    def _ready(self, committed: int) -> list[_Sink]:
        """The loggers to write to now: built, not resting after a failure, and caught up with
        every step before ``committed`` (from ``metrics.jsonl``) and every recorded evaluation."""
        from controller import steplog

        out = []
        now = time.monotonic()
        for s in self._sinks:
            if now < s.retry_at:
                continue
            try:
                if s.sink is None:
                    s.sink = s.build()
                if s.behind:
                    with self.ctx.write_lock:
                        self.ctx.check_leader()
                        rows = steplog.read(self.ctx.workdir / "metrics.jsonl", committed=committed)
                        missing = [r for r in rows if int(r["step"]) not in s.sink.logged]
                        for row in missing:
                            s.sink.write(row)
                        for rec in self.ctx.read_state().get("evals") or []:
                            s.sink.write_eval(rec)
                    s.behind = False
                    if missing:
                        log.info("job %s: %s: wrote %d committed step(s) it lacked", self.ctx.job, s.name,
                                 len(missing))  # fmt: skip
            except NotLeader:
                raise
            except ImportError:  # `check` ran at the start: only a broken install gets here
                raise
            except Exception as e:  # noqa: BLE001 - see committed
                s.failed(self.ctx.job, "opening or catching up" if s.behind else "a write", e)
                continue
            out.append(s)
        return out

    def close(self) -> None:
        for s in self._sinks:
            if s.sink is not None:
                try:
                    s.sink.close()
                except Exception as e:  # noqa: BLE001 - see committed
                    log.warning("job %s: %s: close failed: %s", self.ctx.job, s.name, e)
