"""The controller's HTTP API (JSON under ``/api/v1``), status page and ``/metrics``.

Every controller serves it, leader or standby: reads come from etcd, and
mutations write desired state to etcd (``jobs.submit`` / ``cancel`` /
``scale``), which the leader reconciles toward. So a request gives the same
answer whichever controller takes it, and nothing here needs leadership.

Mutations need ``Authorization: Bearer <token>`` (the token ``rrl up`` keeps in
``$RRL_HOME/token``, mode 0600), and so does reading the workers' logs, which
can hold data and secrets. Other reads are open: the server binds 127.0.0.1
unless told otherwise. ``create_app(store, token=None)`` accepts every
mutation: that is the in-process app the CLI uses when no controller serves
HTTP (its caller can write to etcd anyway).

The RL job's schema lives in ``resilient_rl``; ``validate_spec`` (given by the
caller, like the controller's ``driver_factory``) turns a spec mapping into
``(job id, spec JSON, desired sizes)`` or raises pydantic's ValidationError,
which becomes a 422 naming the fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import Body, Depends, FastAPI, HTTPException, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.concurrency import run_in_threadpool

from .. import events as event_log
from .. import goodput, jobs, keys, liveness, service, worker_logs
from ..store import EtcdError, EtcdUnavailable, Store
from . import pages, views
from .metrics import EtcdCollector
from .timeline import SAMPLE_S as TIMELINE_SAMPLE_S
from .timeline import Timeline

log = logging.getLogger(__name__)

API = "/api/v1"
STATIC = Path(__file__).resolve().parent.parent / "web" / "static"
SpecValidator = Callable[[dict[str, Any]], tuple[str, str, dict[str, Any]]]
MetricsPath = Callable[[jobs.JobRecord], "Path | None"]


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


class ScaleRequest(BaseModel):
    """New group sizes; give one or both."""

    model_config = ConfigDict(extra="forbid", strict=True)
    rollout: int | None = Field(None, ge=1, le=1024, description="Rollout workers.")
    trainer: int | None = Field(None, ge=1, le=1024, description="Trainer world size.")
    strategy: Literal["ddp", "fsdp"] | None = Field(
        None, description="Trainer strategy, applied at the next step boundary (fsdp: sharded, FSDP2)."
    )
    expect: dict[Literal["rollout", "trainer"], int] | None = Field(
        None,
        description="Compare-and-set: change only while these groups' desired sizes are still these "
        "(409 naming the current ones otherwise), so two operators cannot overwrite each other unseen.",
    )

    @model_validator(mode="after")
    def _one(self) -> ScaleRequest:
        if self.rollout is None and self.trainer is None and self.strategy is None:
            raise ValueError("give rollout, trainer and/or strategy")
        return self


class SubmitRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    spec: dict[str, Any] = Field(description="The job spec (the YAML job file as a mapping).")


class Counter:
    """A thread-safe count (etcd errors seen by this process)."""

    def __init__(self) -> None:
        self._n = 0
        self._lock = threading.Lock()

    def inc(self) -> None:
        with self._lock:
            self._n += 1

    @property
    def value(self) -> int:
        return self._n


MAX_POINTS = 20_000


def _thin(points: dict[int, dict[str, Any]]) -> None:
    """Keep memory bounded on a long job: past MAX_POINTS, drop every other older point."""
    if len(points) > MAX_POINTS:
        steps = sorted(points)
        for k in steps[:-1:2]:
            del points[k]


class History:
    """Per-step metrics for the plots.

    From the job's ``metrics.jsonl`` when this host can read it (read
    incrementally), else from the committed states this process has seen
    (a controller that started late shows the steps since it started).
    Each point is ``{step, reward, tokens_per_s, step_seconds, time}`` where
    ``step`` counts committed steps (step k's point sits at k + 1).
    """

    def __init__(self, metrics_path: MetricsPath | None) -> None:
        self.metrics_path = metrics_path
        self._lock = threading.Lock()
        self._seen: dict[str, dict[int, dict[str, Any]]] = {}
        self._files: dict[str, tuple[Path, int, dict[int, dict[str, Any]]]] = {}

    def observe(self, rec: jobs.JobRecord) -> None:
        st = rec.state
        if st.get("step") and st.get("reward") is not None:
            with self._lock:
                self._seen.setdefault(rec.id, {}).setdefault(
                    int(st["step"]),
                    {
                        "step": int(st["step"]),
                        "reward": st.get("reward"),
                        "tokens_per_s": st.get("tokens_per_s"),
                        "step_seconds": st.get("step_seconds"),
                        "time": time.time(),
                    },
                )
                _thin(self._seen[rec.id])

    def get(self, rec: jobs.JobRecord) -> list[dict[str, Any]]:
        self.observe(rec)
        path = self.metrics_path(rec) if self.metrics_path else None
        with self._lock:
            points = self._read_file(rec.id, path) if path is not None else None
            if not points:
                points = dict(self._seen.get(rec.id, {}))
            committed = int(rec.state.get("step") or 0)  # a line is written just before its commit
            return [points[k] for k in sorted(points) if k <= committed]

    def _read_file(self, job: str, path: Path) -> dict[int, dict[str, Any]] | None:
        cached = self._files.get(job)
        if cached is None or cached[0] != path:
            cached = (path, 0, {})
        _, offset, points = cached
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size < offset:  # rewritten: start over
                    offset, points = 0, {}
                f.seek(offset)
                data = f.read()
        except OSError:
            return None
        end = data.rfind(b"\n") + 1  # only whole lines; a line being written is read next time
        for line in data[:end].splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                m = json.loads(line)
                k = int(m["step"]) + 1
                if k in points:  # the first line of a step is the one in commit order (steplog.py)
                    continue
                points[k] = {
                    "step": k,
                    "reward": m.get("reward"),
                    "tokens_per_s": m.get("tokens_per_s"),
                    "step_seconds": m.get("step_seconds"),
                    "time": m.get("time"),
                }
        _thin(points)
        self._files[job] = (path, offset + end, points)
        return points


def _json_safe(x: Any) -> Any:
    """``x`` with non-finite floats as strings (strict JSON has no Infinity or NaN)."""
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return repr(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x


def create_app(
    store: Store,
    *,
    token: str | None,
    served_by: str | None = None,
    validate_spec: SpecValidator | None = None,
    metrics_path: MetricsPath | None = None,
    stream_interval: float = 1.0,
    remove_data: Callable[[jobs.JobRecord], list[str]] | None = None,
    allow_kill: bool = False,
    leadership: Callable[[], int] | None = None,
) -> FastAPI:
    """Build the app. ``token=None`` accepts mutations without a token (in-process use only).
    ``remove_data(rec)`` removes a deleted job's files where this host can reach them and
    returns what it removed. ``allow_kill``: serve the chaos route that SIGKILLs a worker
    (``rrl controller --allow-kill``); off, it answers 403 naming the flag.
    ``leadership()``: this process's fencing token while it leads, else 0; it serves the
    standbys' stream to a live leader (:mod:`controller.liveness`)."""
    timeline = Timeline()
    sampler_stop = threading.Event()

    def sample_workers() -> None:
        """The worker timeline's samples: every running job's members every few seconds."""
        while not sampler_stop.wait(TIMELINE_SAMPLE_S):
            try:
                now = time.time()
                records = jobs.list_all(store)
                for rec in records:
                    if rec.phase not in jobs.TERMINAL:
                        timeline.observe(rec.id, rec.members, now)
                timeline.keep({rec.id for rec in records})  # a deleted job's strips go with it
            except EtcdError:
                continue  # etcd away: a gap in the strips
            except Exception as e:  # noqa: BLE001 - a closed store (the app is going): stop sampling
                log.info("worker timeline sampler stops: %s", e)
                return

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        threading.Thread(target=sample_workers, name="timeline-sampler", daemon=True).start()
        try:
            yield
        finally:
            sampler_stop.set()

    app = FastAPI(
        lifespan=lifespan,
        title="resilient-rl controller",
        version="1",
        description="Jobs, workers, checkpoints and events of resilient-rl, read from etcd. "
        "Mutations write desired state and need `Authorization: Bearer <token>` ($RRL_HOME/token); "
        "so does reading the workers' logs.",
        docs_url=None,  # the interactive docs load their script from a CDN; the schema is at /openapi.json
        redoc_url=None,
    )
    etcd_errors = Counter()
    history = History(metrics_path)
    node = socket.gethostname()
    bearer = HTTPBearer(auto_error=False)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EtcdCollector(store, etcd_errors, history.get))

    # (a default, not Annotated[...]: string annotations cannot see this function's locals)
    def authorize(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if token is None:
            return
        if creds is None or not secrets.compare_digest(creds.credentials.encode(), token.encode()):
            raise HTTPException(
                401,
                "this request changes state and needs the controller's token: "
                "`Authorization: Bearer <token>` with the token in $RRL_HOME/token",
                headers={"WWW-Authenticate": "Bearer"},
            )

    Auth = Depends(authorize)

    @app.exception_handler(RequestValidationError)
    async def _unprocessable(_: Request, e: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler echoes the input, and JSON has no Infinity/NaN (Python's parser
        # accepts them): render what the client sent as text so a bad payload stays a 422
        return JSONResponse({"detail": _json_safe(jsonable_encoder(e.errors()))}, 422)

    @app.exception_handler(jobs.JobNotFound)
    async def _not_found(_: Request, e: jobs.JobNotFound) -> JSONResponse:
        return JSONResponse({"detail": str(e)}, 404)

    @app.exception_handler(keys.InvalidId)
    async def _invalid(_: Request, e: keys.InvalidId) -> JSONResponse:
        return JSONResponse({"detail": [{"loc": ["path", "job"], "msg": str(e), "type": "value_error"}]}, 422)

    async def _conflict(_: Request, e: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(e)}, 409)

    # the request clashes with the job's current state: the message says what it is now
    for conflict in (jobs.JobExists, jobs.JobNotFinished, jobs.NotResumable, jobs.DesiredChanged):
        app.add_exception_handler(conflict, _conflict)

    @app.exception_handler(EtcdError)
    async def _etcd(_: Request, e: EtcdError) -> JSONResponse:
        etcd_errors.inc()
        code = 503 if isinstance(e, EtcdUnavailable) else 502
        return JSONResponse({"detail": f"etcd: {e}"}, code)

    def record(job: str) -> jobs.JobRecord:
        rec = jobs.get(store, keys.check_job_id(job))
        history.observe(rec)
        return rec

    def job_events(job: str) -> list[dict[str, Any]]:
        return event_log.read(store, job, -1, event_log.MAX_EVENTS)

    def view(job: str) -> dict[str, Any]:
        """Everything the job page shows, in one JSON document."""
        rec = record(job)
        evs = job_events(job)
        points = history.get(rec)
        leader = store.get(keys.leader())
        annotated = views.annotate(evs)
        return {
            "summary": views.summary(rec, evs),
            "goodput": goodput.live(points, annotated, rec.spec, rec.state, time.time()),
            "verified": rec.verified,
            "spec": {"steps": rec.spec.get("steps"), "task": rec.spec.get("task", {}).get("kind")},
            "workers": views.workers(rec, evs),
            "checkpoints": views.checkpoint_rows(rec),
            "events": annotated[-300:],
            "timeline": {
                **timeline.get(job, time.time()),
                "faults": [
                    {"time": e["time"], "kind": e["kind"], "group": e.get("group"), "worker": e.get("worker")}
                    for e in annotated
                    if e.get("category") == "fault"
                ],
            },
            "history": views.downsample(points),
            "evals": rec.state.get("evals") or [],  # the last 100 evaluations (spec.eval), by step
            "markers": views.markers(evs, points),
            "leader": leader.value.decode() if leader else None,
            "controllers": service.controllers(store),
            "served_by": served_by,
            "allow_kill": allow_kill,
            "time": time.time(),
        }

    # -- reads ----------------------------------------------------------------

    @app.get(f"{API}/jobs", tags=["jobs"])
    def list_jobs() -> dict[str, Any]:
        """Every job with its overview line (phase, step, reward, failures, recoveries)."""
        out = []
        for rec in jobs.list_all(store):
            history.observe(rec)
            out.append(views.summary(rec, job_events(rec.id)))
        return {"jobs": out}

    @app.get(f"{API}/jobs/{{job}}", tags=["jobs"])
    def get_job(job: str) -> dict[str, Any]:
        """The job's record (spec, desired, state, members, checkpoints), its overview line and its
        goodput (ETTR since the start and over the last hour, lost work: ``controller/goodput.py``)."""
        rec = record(job)
        evs = job_events(job)
        live = goodput.live(history.get(rec), views.annotate(evs), rec.spec, rec.state, time.time())
        return {**rec.to_dict(), "summary": views.summary(rec, evs), "goodput": live}

    @app.get(f"{API}/jobs/{{job}}/view", tags=["jobs"])
    def get_view(job: str) -> dict[str, Any]:
        """What the job page shows: summary, workers, checkpoints, events, plot data, leader."""
        return view(job)

    @app.get(f"{API}/jobs/{{job}}/events", tags=["jobs"])
    def get_events(
        job: str,
        after: Annotated[int, Query(ge=-1, description="Return events with seq > after.")] = -1,
        limit: Annotated[int, Query(ge=1, le=event_log.MAX_EVENTS)] = 100,
    ) -> dict[str, Any]:
        """A page of the event log, oldest first; pass ``next_after`` as ``after`` for the next page."""
        record(job)
        evs = event_log.read(store, job, after, limit)
        return {"events": evs, "next_after": evs[-1]["seq"] if evs else after}

    @app.get(f"{API}/jobs/{{job}}/logs", tags=["jobs"], dependencies=[Auth])
    def get_logs(
        job: str,
        group: Annotated[
            Literal["rollout", "trainer"] | None,
            Query(description="rollout or trainer (its spares included); none: every worker."),
        ] = None,
        worker: Annotated[
            int | None, Query(ge=0, le=1_000_000, description="One worker of the group: every incarnation of it.")
        ] = None,
        after: Annotated[
            float | None, Query(ge=0, description="A page of the lines after this time (next_after); else the tail.")
        ] = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    ) -> dict[str, Any]:
        """What the job's workers wrote to stdout and stderr (captured into ``<workdir>/logs``),
        merged in time order: tracebacks of reward functions, trainer errors, library warnings.
        Logs can hold data and secrets, so unlike the other reads this one needs the token."""
        rec = record(job)
        if worker is not None and group is None:
            raise HTTPException(422, "worker needs group (rollout or trainer)")
        path = metrics_path(rec) if metrics_path is not None else None
        if path is None:
            raise HTTPException(404, "this controller cannot locate the job's workdir (a spec of another version?)")
        folder = path.parent / "logs"
        every = worker_logs.list_files(folder)
        files = worker_logs.select(every, group, worker)
        lines = worker_logs.read(files, after=after, limit=limit)
        return {
            "lines": [{"time": x.time, "source": x.source, "pid": x.pid, "text": x.text} for x in lines],
            "next_after": lines[-1].time if lines else after,
            "files": [{"name": f.name, "pid": f.pid, "bytes": sum(_size(p) for p in f.paths)} for f in files],
            "folder": str(folder),
            "exists": folder.is_dir(),
        }

    @app.get(f"{API}/jobs/{{job}}/members", tags=["jobs"])
    def get_members(job: str) -> dict[str, Any]:
        """Workers per group from their membership records (restarts, age of the last progress update)."""
        return views.workers(record(job), job_events(job))

    @app.get(f"{API}/jobs/{{job}}/checkpoints", tags=["jobs"])
    def get_checkpoints(job: str) -> list[dict[str, Any]]:
        """Committed snapshots, oldest first."""
        return views.checkpoint_rows(record(job))

    @app.get(f"{API}/leader", tags=["controllers"])
    def get_leader() -> dict[str, Any]:
        """The leading controller's id and fencing token (the leader key's create revision)."""
        kv = store.get(keys.leader())
        return {"id": kv.value.decode(), "token": kv.create_revision} if kv else {"id": None, "token": None}

    @app.get(f"{API}/controllers", tags=["controllers"])
    def get_controllers() -> list[dict[str, Any]]:
        """Live controllers, leader first, with the HTTP address each serves."""
        return service.controllers(store)

    @app.get(f"{API}/jobs/{{job}}/stream", tags=["jobs"], response_class=StreamingResponse)
    async def stream(job: str, request: Request) -> StreamingResponse:
        """Server-sent events: a ``view`` event (the document of ``/view``) every second."""
        await run_in_threadpool(record, job)  # 404 / 422 before the stream starts

        async def gen() -> AsyncIterator[str]:
            while not await request.is_disconnected():
                try:
                    doc = await run_in_threadpool(view, job)
                    yield f"event: view\ndata: {json.dumps(doc)}\n\n"
                except jobs.JobNotFound:
                    yield "event: gone\ndata: {}\n\n"
                    return
                except EtcdError as e:  # etcd is down for a while: say so and keep trying
                    etcd_errors.inc()
                    yield f"event: trouble\ndata: {json.dumps({'detail': str(e)})}\n\n"
                await asyncio.sleep(stream_interval)

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(gen(), media_type="text/event-stream", headers=headers)

    # -- mutations (token) ----------------------------------------------------

    @app.post(f"{API}/jobs", tags=["jobs"], status_code=201, dependencies=[Auth])
    def submit_job(req: SubmitRequest) -> dict[str, Any]:
        """Validate a spec and create the job (spec + desired); 409 if the id is taken."""
        if validate_spec is None:
            raise HTTPException(501, "this server cannot validate job specs")
        try:
            job_id, spec_json, desired = validate_spec(req.spec)
        except ValidationError as e:
            raise HTTPException(422, [_spec_error(err) for err in e.errors()]) from None
        jobs.submit(store, job_id, spec_json, desired)
        return {"id": job_id, "desired": desired}

    @app.post(f"{API}/jobs/{{job}}/resume", tags=["jobs"], dependencies=[Auth])
    def resume_job(job: str) -> dict[str, Any]:
        """Ask the leader to resume a PAUSED job now (desired.resume)."""
        return {"id": job, "desired": jobs.resume(store, keys.check_job_id(job))}

    @app.delete(f"{API}/jobs/{{job}}", tags=["jobs"], dependencies=[Auth])
    def delete_job(job: str) -> dict[str, Any]:
        """Delete a finished job's records (409 while it runs) and its files on this host; the
        name can then be used again."""
        rec = jobs.delete(store, keys.check_job_id(job))
        return {"id": job, "removed": remove_data(rec) if remove_data else []}

    @app.post(f"{API}/jobs/{{job}}/cancel", tags=["jobs"], dependencies=[Auth])
    def cancel_job(job: str) -> dict[str, Any]:
        """Ask the leader to cancel the job (desired.cancel)."""
        return {"id": job, "desired": jobs.cancel(store, keys.check_job_id(job))}

    @app.post(f"{API}/jobs/{{job}}/scale", tags=["jobs"], dependencies=[Auth])
    def scale_job(job: str, req: Annotated[ScaleRequest, Body()]) -> dict[str, Any]:
        """Ask for new group sizes (desired); rollout changes live, trainer at a step boundary.

        ``written`` is what this request wrote; ``desired`` is read back after it, so a caller racing
        another sees the value that holds now (use ``expect`` to refuse instead)."""
        groups = {g: n for g, n in (("rollout", req.rollout), ("trainer", req.trainer)) if n is not None}
        job = keys.check_job_id(job)
        expect = {str(g): n for g, n in req.expect.items()} if req.expect else None
        written = jobs.scale(store, job, expect=expect, strategy=req.strategy, **groups)
        return {"id": job, "written": written, "desired": jobs.read_desired(store, job)}

    @app.post(f"{API}/jobs/{{job}}/workers/{{group}}/{{worker}}/kill", tags=["chaos"], dependencies=[Auth])
    def kill_worker(job: str, group: str, worker: str) -> dict[str, Any]:
        """Chaos: SIGKILL a worker's process, by the pid in its membership record.

        Only when the worker runs on this controller's host (409 otherwise: ask a
        controller on its node), and only on a controller started with ``--allow-kill``
        (403 otherwise). The leader then sees the fault and recovers.
        """
        if not allow_kill:
            raise HTTPException(403, "the kill route is off: start the controller with --allow-kill (chaos testing)")
        rec = record(job)
        info = rec.members.get(group, {}).get(worker)
        if info is None:
            raise HTTPException(404, f"{job} has no worker {group}/{worker}")
        pid = int(info.get("pid") or 0)
        if info.get("node") != node:
            raise HTTPException(409, f"worker {group}/{worker} runs on {info.get('node')}, this controller on {node}")
        if pid <= 1 or pid == os.getpid():
            raise HTTPException(409, f"refusing to kill pid {pid}")
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            raise HTTPException(410, f"worker {group}/{worker} (pid {pid}) is already gone") from None
        log.warning("killed worker %s/%s/%s (pid %d) on request", job, group, worker, pid)
        return {"id": job, "group": group, "worker": worker, "pid": pid, "killed": True}

    # -- metrics, health, pages -----------------------------------------------

    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get(f"{API}/leader/alive", include_in_schema=False)
    async def leader_alive(token: Annotated[int, Query(ge=1)]) -> StreamingResponse:
        """A line a second while this controller leads with ``token``, then ``bye``; a standby
        that sees the stream end without ``bye`` knows this process is gone (409: not leading)."""
        if leadership is None or leadership() != token:
            raise HTTPException(409, f"this controller does not lead with token {token}")
        body = liveness.alive_lines(lambda t: leadership() == t, token)
        return StreamingResponse(body, media_type="text/plain", headers={"Cache-Control": "no-cache"})

    @app.get("/healthz", include_in_schema=False)
    def healthz() -> dict[str, Any]:
        return {"ok": True, "served_by": served_by}

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index_page() -> HTMLResponse:
        rows = []
        for rec in jobs.list_all(store):
            rows.append(views.summary(rec, job_events(rec.id)))
        return HTMLResponse(pages.index(rows, served_by))

    @app.get("/jobs/{job}", response_class=HTMLResponse, include_in_schema=False)
    def job_page(job: str) -> HTMLResponse:
        return HTMLResponse(pages.job(view(job)))

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def _spec_error(err: Any) -> dict[str, Any]:
    loc = ["body", "spec", *[p for p in err["loc"] if not str(p).startswith("function-")]]
    return {"loc": loc, "msg": err["msg"], "type": err["type"], "field": ".".join(str(p) for p in loc[2:])}
