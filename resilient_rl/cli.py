"""``rrl``: the command line of resilient-rl.

Kept light on purpose: importing this module pulls in typer, rich, pydantic
and the etcd client only, so ``rrl --help`` answers at once. torch, Ray and vLLM
are imported inside the commands (and worker actors) that need them.

Exit codes: 0 ok, 1 runtime error (etcd unreachable, job failed), 2 bad input
(invalid job file, unknown option).
"""

from __future__ import annotations

import errno
import inspect
import json
import logging
import os
import re
import signal
import sys
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console

from .signals import exit_on_sigterm

app = typer.Typer(
    name="rrl",
    help="resilient-rl: RL post-training for LLMs that keeps running through failures.\n\n"
    "Quick start: `rrl up` starts a local etcd, Ray head and controller; "
    "`rrl submit job.yaml` runs a job; `rrl status` shows it; `rrl down` stops everything.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)
# soft wrap: a long line (a path, an error) stays one line when piped to grep or a file; a
# terminal wraps it for the eye. Tables are laid out to the width as before.
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


class Strategy(StrEnum):
    """Trainer strategies (``trainer.strategy``)."""

    ddp = "ddp"
    fsdp = "fsdp"


EtcdOpt = Annotated[
    str | None,
    typer.Option(
        "--etcd",
        envvar="RRL_ETCD",
        help="etcd endpoints host:port[,host:port...] (default: the one `rrl up` started).",
    ),
]
OutputOpt = Annotated[str, typer.Option("--output", "-o", help="table or json.")]
ApiOpt = Annotated[
    str | None,
    typer.Option(
        "--api",
        envvar="RRL_API",
        help="Controller API URL, e.g. http://127.0.0.1:8470 (default: a controller registered in etcd).",
    ),
]


def fail(message: str, code: int = 1) -> NoReturn:
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _store(etcd: str | None, **creds: str | None) -> Any:
    """The Store every command uses. TLS and auth: ``creds`` (ca_cert, cert, key, user,
    password; the `controller` command's flags), else the RRL_ETCD_* variables, which
    controller/store.py reads itself, so Ray workers get them from their environment too."""
    from controller.store import Store

    from .local import Platform

    endpoints = etcd or Platform().etcd_endpoint()
    if not endpoints:
        fail("no etcd to talk to: run `rrl up` to start a local one, or pass --etcd host:port (or set RRL_ETCD)")
    try:
        return Store(endpoints, timeout=2.0, retry_window=5.0, **{k: v for k, v in creds.items() if v is not None})
    except ValueError as e:
        fail(f"--etcd: {e}", 2)


def _guard(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run an etcd-backed operation; turn etcd / lookup errors into clear CLI errors."""
    from controller.jobs import JobExists, JobNotFound
    from controller.keys import InvalidId
    from controller.store import EtcdError, EtcdUnavailable

    try:
        return fn(*args, **kwargs)
    except EtcdUnavailable as e:
        fail(f"cannot reach etcd ({e}). Is it running? `rrl up` starts a local one.")
    except (JobNotFound, InvalidId) as e:
        fail(str(e))
    except JobExists as e:
        fail(str(e))
    except EtcdError as e:
        fail(f"etcd error: {e}")


def _api(etcd: str | None, api: str | None = None) -> Any:
    """The client for job operations: ``--api``, else a controller registered in etcd (leader
    first), else the same API in-process against etcd (see controller/http/client.py)."""
    from controller.http.client import ApiClient

    from .local import read_token

    if api:
        return ApiClient([_api_url(api)], read_token())
    store = _store(etcd)
    return _guard(ApiClient.discover, store, read_token(), lambda: _local_app(store))


def _api_url(api: str) -> str:
    """``--api`` checked: an http(s) URL with a host and a port in range (exit 2 otherwise)."""
    from urllib.parse import urlsplit

    try:
        u = urlsplit(api.strip())
        port = u.port  # raises ValueError when out of range or not a number
    except ValueError as e:
        fail(f"--api: {api!r} is not a URL ({e})", 2)
    if u.scheme not in ("http", "https") or not u.hostname:
        fail(f"--api: {api!r} must be an http:// or https:// URL with a host, e.g. http://127.0.0.1:8470", 2)
    if port == 0:
        fail(f"--api: {api!r}: the port must be from 1 to 65535", 2)
    return api.strip().rstrip("/")


def _local_app(store: Any, served_by: str = "rrl (in-process)") -> Any:
    from controller.http.api import create_app

    return create_app(store, token=None, served_by=served_by, validate_spec=_validate_spec, metrics_path=_metrics_path,
                      remove_data=_remove_data)  # fmt: skip


def _validate_spec(data: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """The API's spec check (raises pydantic's ValidationError, which the API turns into a 422)."""
    from .spec import JobSpec

    spec = JobSpec.model_validate(data)
    return spec.name, spec.to_json(), {"rollout": spec.rollout.replicas, "trainer": spec.trainer.replicas}


def _remove_data(rec: Any) -> list[str]:
    """Remove what rrl wrote in a deleted job's folder (journal, snapshots, metrics, a model it
    made) and the folder if that leaves it empty: never anything else, since checkpoint.dir
    may be a folder of the user's."""
    import shutil

    from .naming import MODEL_MARKER, job_workdir
    from .spec import JobSpec

    try:
        work = job_workdir(JobSpec.model_validate(rec.spec))
    except ValueError:
        return []
    removed = []
    for name in ("journal", "snapshots", "metrics.jsonl", "model"):
        p = work / name
        if name == "model" and not (p / MODEL_MARKER).exists():
            continue  # not made by rrl
        if name in ("journal", "snapshots") and p.is_dir() and any(not x.name.startswith("step-") for x in p.iterdir()):
            continue  # holds something rrl did not write: left alone
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
        else:
            continue
        removed.append(str(p))
    for p in work.glob("rrl-verify-*"):
        shutil.rmtree(p, ignore_errors=True)
    try:
        work.rmdir()
        removed.append(str(work))
    except OSError:
        pass  # not empty: the user's own files stay
    return removed


_workdirs: dict[tuple[str, float], Path] = {}


def _metrics_path(rec: Any) -> Path | None:
    """Where the job's runner writes metrics.jsonl (read by the page's plots when on this host)."""
    key = (rec.id, rec.desired.get("submitted_at", 0.0))
    if key not in _workdirs:
        from .naming import job_workdir
        from .spec import JobSpec

        try:
            _workdirs[key] = job_workdir(JobSpec.model_validate(rec.spec)) / "metrics.jsonl"
        except ValueError:  # a spec from another version of rrl: no plots from files
            return None
    return _workdirs[key]


def _jp(job: str, tail: str = "") -> str:
    """The API path of a job (its id checked here: an id with '/' in it would be another path)."""
    from controller.keys import check_job_id

    return f"/api/v1/jobs/{_guard(check_job_id, job)}{tail}"


def _call(client: Any, method: str, path: str, body: Any = None, **params: Any) -> Any:
    """One API call; API and connection errors become clear CLI errors (exit 1, or 2 for 422)."""
    from controller.http.client import ApiError, Unreachable

    try:
        if method == "GET":
            return client.get(path, **params)
        if method == "DELETE":
            return client.delete(path)
        return client.post(path, body)
    except ApiError as e:
        where = f" (controller {client.url})" if client.url else ""
        if e.status == 401:
            fail(f"the API refused the request{where}: {e.message}. Set RRL_TOKEN or check $RRL_HOME/token.")
        if e.status == 503:
            fail(f"cannot reach etcd ({e.message}). Is it running? `rrl up` starts a local one.")
        fail(e.message, 2 if e.status == 422 else 1)
    except Unreachable as e:
        fail(f"{e}. Is a controller running? `rrl up` starts one.")


def _check_output(output: str) -> None:
    if output not in ("table", "json"):
        fail(f"--output must be 'table' or 'json', not {output!r}", 2)


# --- platform ---------------------------------------------------------------


@app.command()
def up(
    etcd: EtcdOpt = None,
    ray_address: Annotated[
        str | None,
        typer.Option("--ray-address", envvar="RAY_ADDRESS", help="Use this Ray cluster instead of starting one."),
    ] = None,
    controllers: Annotated[int, typer.Option(min=1, max=5, help="Controller processes (1 leader + standbys).")] = 1,
    allow_kill: Annotated[
        bool | None,
        typer.Option(
            "--allow-kill/--no-allow-kill",
            help="Chaos testing: controllers serve the kill-a-worker route and button (kept for later `rrl up`s).",
        ),
    ] = None,
    object_store_gib: Annotated[
        float | None,
        typer.Option(
            "--object-store-gib",
            min=0,
            max=1024,
            help="Ray head's object store in GiB, every page written once at start: published weights then land "
            "in touched memory (a 100M-parameter sync to 4 workers 2.5x the memcpy floor instead of 7.6x, "
            "BENCHMARKS.md section 4). Needs that much free in /dev/shm. Default: Ray's (30% of memory), not "
            "preallocated; 0 goes back to it. Kept for later `rrl up`s.",
        ),
    ] = None,
) -> None:
    """Start the local platform (etcd, Ray head, controller) if not already running."""
    from .local import Platform, PlatformError, PlatformInputError

    try:
        data = Platform().up(etcd=etcd, ray_address=ray_address, controllers=controllers, progress=out.print,
                             allow_kill=allow_kill, object_store_gib=object_store_gib)  # fmt: skip
    except PlatformInputError as e:  # checked before anything started
        fail(str(e), 2)
    except PlatformError as e:
        fail(str(e))
    out.print(f"[green]platform up[/]: etcd {data['etcd']}, ray {data['ray']}, home {Platform().home}")
    pages = list((data.get("api") or {}).values())
    if pages:
        out.print(f"status page: {pages[0]}/  (`rrl ui --with-token` adds the token for its buttons)", highlight=False)


@app.command()
def run(
    job_file: Annotated[Path, typer.Argument(help="Job spec (YAML).")],
    name: Annotated[str | None, typer.Option("--name", help="Override the job's name (its id).")] = None,
) -> None:
    """One shot: `rrl up`, submit the job, follow it to the end (the platform stays up)."""
    from .local import Platform, PlatformError, PlatformInputError
    from .spec import SpecError, load_spec

    try:
        spec = load_spec(job_file, {"name": name} if name else None)
    except SpecError as e:
        fail(str(e), 2)
    try:
        data = Platform().up(progress=out.print)
    except PlatformInputError as e:  # a value kept in platform.json
        fail(str(e), 2)
    except PlatformError as e:
        fail(str(e))
    client = _api(data["etcd"])
    _call(client, "POST", "/api/v1/jobs", {"spec": json.loads(spec.to_json())})
    out.print(f"submitted job [bold]{spec.name}[/] ({spec.steps} steps)")
    raise typer.Exit(_follow(client, spec.name))


@app.command("init-model")
def init_model(
    out_dir: Annotated[Path, typer.Argument(help="Folder to write the model and tokenizer to.")],
    hidden_size: Annotated[int, typer.Option(help="Model width (head dim = hidden/heads must be 64 or 128).")] = 128,
    num_layers: Annotated[int, typer.Option(help="Transformer blocks.")] = 2,
    num_heads: Annotated[int, typer.Option(help="Attention heads.")] = 2,
    num_kv_heads: Annotated[int, typer.Option(help="Key/value heads.")] = 1,
    seed: Annotated[int, typer.Option(help="Initialisation seed.")] = 0,
) -> None:
    """Write a tiny random Qwen2-style model + character tokenizer (offline; loads in vLLM and transformers)."""
    from pydantic import ValidationError

    from .spec import TinyModelInit

    try:
        init = TinyModelInit(
            hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, seed=seed
        )
    except ValidationError as e:  # each error named by its option (a check across options has none)
        fail("; ".join(("--" + str(err["loc"][0]).replace("_", "-") + ": " if err["loc"] else "") + err["msg"]
                       for err in e.errors()), 2)  # fmt: skip
    from .algo.tasks import VOCAB_CHARS
    from .workers.model_init import make_tiny_model

    try:
        path = make_tiny_model(out_dir, init, VOCAB_CHARS)
    except OSError as e:  # the folder given cannot take it (exit 2), or the disk failed (exit 1)
        if e.strerror is None:  # make_tiny_model's own refusal names the folder
            fail(str(e), 2)
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(out_dir) else ""
        code = 1 if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO) else 2
        fail(f"{out_dir}: cannot write the model: {e.strerror}{where}", code)
    out.print(f"wrote tiny model to {path}")


@app.command()
def down() -> None:
    """Stop exactly the processes `rrl up` started (by PID). Data under $RRL_HOME is kept."""
    from .local import Platform, PlatformInputError

    try:
        stopped = Platform().down(progress=out.print)
    except PlatformInputError as e:
        fail(str(e), 2)
    out.print("[green]platform down[/]" if stopped else "nothing was running")


@app.command()
def controller(
    etcd: EtcdOpt = None,
    ray_address: Annotated[str | None, typer.Option("--ray-address", envvar="RAY_ADDRESS")] = None,
    id: Annotated[str | None, typer.Option("--id", help="Controller id (default host-pid).")] = None,
    ttl: Annotated[int, typer.Option(min=2, help="Leader lease TTL in seconds.")] = 5,
    http_host: Annotated[
        str, typer.Option("--http-host", envvar="RRL_HTTP_HOST", help="Address the API and page bind (loopback).")
    ] = "127.0.0.1",
    http_port: Annotated[int, typer.Option("--http-port", min=0, max=65535, help="0: any free port.")] = 0,
    token_file: Annotated[
        Path | None, typer.Option("--token-file", help="API token for mutations (default $RRL_HOME/token; created).")
    ] = None,
    etcd_ca: Annotated[
        Path | None, typer.Option("--etcd-ca", envvar="RRL_ETCD_CA", help="CA certificate (PEM) of etcd: TLS.")
    ] = None,
    etcd_cert: Annotated[
        Path | None, typer.Option("--etcd-cert", envvar="RRL_ETCD_CERT", help="Client certificate (PEM) for etcd.")
    ] = None,
    etcd_key: Annotated[
        Path | None, typer.Option("--etcd-key", envvar="RRL_ETCD_KEY", help="Key (PEM) of the client certificate.")
    ] = None,
    etcd_user: Annotated[
        str | None, typer.Option("--etcd-user", envvar="RRL_ETCD_USER", help="etcd user name (auth).")
    ] = None,
    etcd_password_file: Annotated[
        Path | None,
        typer.Option(
            "--etcd-password-file",
            help="File holding the etcd user's password (or set RRL_ETCD_PASSWORD; never a flag: ps shows flags).",
        ),
    ] = None,
    allow_kill: Annotated[
        bool,
        typer.Option(
            "--allow-kill",
            help="Chaos testing: serve POST .../workers/{group}/{worker}/kill (SIGKILL a worker on this host) "
            "and show its button on the page. Off by default.",
        ),
    ] = False,
) -> None:
    """Run a controller in the foreground (leader or standby), serving the HTTP API, the status
    page and /metrics. `rrl up` starts these for you.

    etcd TLS/auth: the flags, else RRL_ETCD_CA/CERT/KEY/USER/PASSWORD. Ray workers read the
    RRL_ETCD_* variables of their own environment (set them where Ray runs, too)."""
    from controller.http.api import create_app
    from controller.http.server import HttpServer
    from controller.service import Controller

    from .job.reaper import WorkerReaper
    from .job.runner import runner_factory  # light: Ray is imported when the first job runs
    from .local import ensure_token, token_path

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    password = None
    if etcd_password_file is not None:
        try:
            password = etcd_password_file.read_text().strip()
        except OSError as e:
            fail(f"--etcd-password-file {etcd_password_file}: {e.strerror or e}", 2)
    creds = {
        "ca_cert": etcd_ca and str(etcd_ca),
        "cert": etcd_cert and str(etcd_cert),
        "key": etcd_key and str(etcd_key),
        "user": etcd_user,
        "password": password,
    }
    store = _store(etcd, **creds)
    # what this process starts (a local Ray, job runners' workers on it) builds its Store from RRL_ETCD_*
    env_names = {"ca_cert": "RRL_ETCD_CA", "cert": "RRL_ETCD_CERT", "key": "RRL_ETCD_KEY", "user": "RRL_ETCD_USER"}
    os.environ.update({env_names.get(k, "RRL_ETCD_PASSWORD"): v for k, v in creds.items() if v is not None})
    token = ensure_token(token_file or token_path())
    cid = id or f"{os.uname().nodename}-{os.getpid()}"
    app_ = create_app(store, token=token, served_by=cid, validate_spec=_validate_spec, metrics_path=_metrics_path,
                      allow_kill=allow_kill, leadership=lambda: c.token if c.leads else 0,
                      remove_data=_remove_data)  # fmt: skip
    try:
        http = HttpServer(app_, http_host, http_port).start()
    except OSError as e:
        fail(f"cannot serve HTTP on {http_host}:{http_port}: {e.strerror or e}")
    c = Controller(
        store,
        cid,
        ttl=ttl,
        info={"ray": ray_address, "http": http.url},
        driver_factory=runner_factory(ray_address, store.endpoints),
        housekeeping=WorkerReaper(ray_address),
    )
    signal.signal(signal.SIGTERM, lambda *_: c.stop())
    signal.signal(signal.SIGINT, lambda *_: c.stop())
    logging.getLogger(__name__).info("controller %s serves %s/", cid, http.url)
    try:
        c.run()
    finally:
        http.stop()


@app.command()
def ui(
    with_token: Annotated[
        bool, typer.Option("--with-token", help="Append #token=... so the page's actions work at once.")
    ] = False,
    etcd: EtcdOpt = None,
    api: ApiOpt = None,
) -> None:
    """Print the URL of the live status page (served by every controller)."""
    from controller import service

    from .local import Platform, read_token

    if api:
        urls = [api.rstrip("/")]
    else:
        urls = [c["http"] for c in _guard(service.controllers, _store(etcd)) if c.get("http")]
        urls = urls or list((Platform().load().get("api") or {}).values())
    if not urls:
        fail("no controller serves the page: `rrl up` starts one")
    token = read_token() if with_token else None
    print(urls[0] + "/" + (f"#token={token}" if token else ""))


# --- jobs -------------------------------------------------------------------


@app.command()
def submit(
    job_file: Annotated[Path, typer.Argument(help="Job spec (YAML). See examples/.")],
    name: Annotated[str | None, typer.Option("--name", help="Override the job's name (its id).")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Show live progress until the job ends.")] = False,
    replace: Annotated[
        bool, typer.Option("--replace", help="If a finished job has this name, delete it (records and data) first.")
    ] = False,
    etcd: EtcdOpt = None,
    api: ApiOpt = None,
) -> None:
    """Validate a job file and submit it; the leader controller picks it up."""
    from controller.http.client import ApiError

    from .spec import SpecError, load_spec

    try:
        spec = load_spec(job_file, {"name": name} if name else None)
    except SpecError as e:
        fail(str(e), 2)
    client = _api(etcd, api)
    if replace:
        try:
            client.delete(_jp(spec.name))
            out.print(f"deleted the finished job {spec.name}")
        except ApiError as e:
            if e.status != 404:
                fail(e.message)
    _call(client, "POST", "/api/v1/jobs", {"spec": json.loads(spec.to_json())})
    out.print(f"submitted job [bold]{spec.name}[/] ({spec.steps} steps). Follow it with `rrl status {spec.name}`.")
    if follow:
        raise typer.Exit(_follow(client, spec.name))


def _follow(client: Any, job: str) -> int:
    """Live progress bar until the job ends; prints a summary. Returns the exit code."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from controller.jobs import TERMINAL

    rec = _call(client, "GET", _jp(job))
    total = int(rec["spec"].get("steps", 0))
    cols = [TextColumn("[bold]{task.fields[phase]}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[info]}")]  # fmt: skip
    with Progress(*cols, console=out, transient=False) as bar:
        task = bar.add_task(job, total=total, phase=rec["phase"], info="")
        while True:
            rec = _call(client, "GET", _jp(job))
            st = rec["state"]
            reward = st.get("reward")
            info = f"policy v{st.get('policy_version', 0)}"
            if reward is not None:
                info += f"  reward {reward:.3f}"
            if st.get("tokens_per_s"):
                info += f"  {st['tokens_per_s']:.0f} tok/s"
            if rec["phase"] == "PAUSED" and st.get("reason"):  # it resumes by itself: say why it waits
                info += f"  {st['reason']}"
            bar.update(task, completed=st.get("step", 0), phase=rec["phase"], info=info)
            if rec["phase"] in (*TERMINAL, "QUARANTINED"):  # quarantined: nothing runs it until `rrl resume`
                break
            time.sleep(1.0)
    st = rec["state"]
    now = time.time()
    took = max(0.0, (st.get("finished_at") or now) - (st.get("started_at") or now))
    colour = "green" if rec["phase"] == "SUCCEEDED" else "red"
    out.print(f"[{colour}]{job} {rec['phase']}[/] after {st.get('step', 0)}/{total} steps in {took:.0f}s"
              + (f": {st['reason']}" if st.get("reason") else ""))  # fmt: skip
    return 0 if rec["phase"] == "SUCCEEDED" else 1


def _job_row(j: dict[str, Any]) -> list[str]:
    """One table row from the API's job summary."""
    reward = j.get("reward")
    want, n = j.get("desired") or {}, j.get("workers") or {}
    workers = " ".join(f"{g} {n.get(g, 0)}/{want[g]}" for g in ("rollout", "trainer") if want.get(g) is not None)
    return [
        j["id"],
        j["phase"],
        f"{j['step']}/{j['steps'] or '?'}",
        str(j.get("policy_version", 0)),
        "-" if reward is None else f"{reward:.3f}",
        workers,
    ]


def _table(headers: tuple[str, ...], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell, two spaces apart, no cell ever wrapped or cut (as
    kubectl prints): a line longer than the terminal runs on rather than break a value."""
    cells = [list(headers), *rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def _jobs_table(summaries: list[dict[str, Any]]) -> str:
    return _table(("JOB", "PHASE", "STEP", "POLICY", "REWARD", "WORKERS"), [_job_row(j) for j in summaries])


@app.command()
def status(
    job: Annotated[str | None, typer.Argument(help="A job id (default: all jobs and the controllers).")] = None,
    output: OutputOpt = "table",
    etcd: EtcdOpt = None,
    api: ApiOpt = None,
) -> None:
    """Show jobs (phase, step, policy version, reward, workers) and controllers."""
    _check_output(output)
    client = _api(etcd, api)
    if job is not None:
        rec = _call(client, "GET", _jp(job))
        if output == "json":
            out.print_json(json.dumps(rec))
            return
        print(_jobs_table([rec["summary"]]))
        if rec["state"].get("reason"):
            out.print(f"reason: {rec['state']['reason']}")
        v = rec.get("verified")
        if v:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(v["time"]))
            print(f"verify ({when}): " + (f"match, {v['steps']} steps replayed" if v.get("match") else
                                          f"MISMATCH ({v.get('error') or 'the replay gives other weights'})"))  # fmt: skip
        e = rec["state"].get("eval")
        if e:
            print(f"eval (policy v{e['version']}, after step {e['step']}): reward {e['reward']:.3f}, "
                  f"pass@{e['k']} {e['pass_at_k']:.3f} over {e['prompts']} prompts"
                  f"{'' if e.get('versions') == [e['version']] else ' (samples of versions ' + str(e.get('versions')) + ')'}"
                  f"; {len(rec['state'].get('evals') or [])} evaluation(s) recorded")  # fmt: skip
        g = rec.get("goodput") or {}
        if g.get("ettr") is not None:
            print(f"goodput: ETTR {g['ettr']:.3f} since the first step, "
                  + (f"{g['ettr_last_hour']:.3f}" if g.get("ettr_last_hour") is not None else "-")
                  + f" over the last hour; {g.get('steps_replayed', 0)} steps replayed, "
                  f"{g.get('samples_regenerated_est', 0)} samples regenerated (estimate), "
                  f"{g.get('recovery_s', 0)} s in recovery over {g.get('faults', 0)} fault(s)")  # fmt: skip
        if rec["summary"].get("reward_errors"):
            out.print(f"reward errors: {rec['summary']['reward_errors']} samples scored 0 (`rrl events {job}`)")
        for group, members in sorted(rec["members"].items()):
            for w, info in sorted(members.items()):
                out.print(
                    f"  {group}/{w}: {info.get('status')} pid {info.get('pid')} on {info.get('node')} "
                    f"policy v{info.get('version', '-')}"
                )
        return
    summaries = _call(client, "GET", "/api/v1/jobs")["jobs"]
    ctrls = _call(client, "GET", "/api/v1/controllers")
    if output == "json":
        out.print_json(json.dumps({"jobs": summaries, "controllers": ctrls}))
        return
    print(_jobs_table(summaries) if summaries else "no jobs")
    leader = next((c["id"] for c in ctrls if c["leader"]), None)
    out.print(f"controllers: {len(ctrls)} ({'leader ' + leader if leader else 'no leader'})")
    if ctrls and ctrls[0].get("http"):
        out.print(f"status page: {ctrls[0]['http']}/  (`rrl ui`)", highlight=False)


@app.command("list")
def list_(output: OutputOpt = "table", etcd: EtcdOpt = None, api: ApiOpt = None) -> None:
    """List jobs, one line each."""
    _check_output(output)
    summaries = _call(_api(etcd, api), "GET", "/api/v1/jobs")["jobs"]
    if output == "json":
        out.print_json(json.dumps([{"id": j["id"], "phase": j["phase"], "step": j["step"]} for j in summaries]))
    elif summaries:
        print(_jobs_table(summaries))
    else:
        out.print("no jobs")


@app.command()
def cancel(job: Annotated[str, typer.Argument(help="Job id.")], etcd: EtcdOpt = None, api: ApiOpt = None) -> None:
    """Cancel a job: the leader stops its workers and marks it CANCELLED."""
    _call(_api(etcd, api), "POST", _jp(job, "/cancel"))
    out.print(f"cancel requested for {job}")


@app.command()
def resume(job: Annotated[str, typer.Argument(help="Job id.")], etcd: EtcdOpt = None, api: ApiOpt = None) -> None:
    """Resume a PAUSED job now (a job paused on a full journal disk also resumes by itself), or lift
    the quarantine of a QUARANTINED one (its driver made two leaders in a row die or step down)."""
    _call(_api(etcd, api), "POST", _jp(job, "/resume"))
    out.print(f"resume requested for {job}")


@app.command()
def delete(job: Annotated[str, typer.Argument(help="Job id.")], etcd: EtcdOpt = None, api: ApiOpt = None) -> None:
    """Delete a finished job: its records in etcd and the data rrl wrote (journal, snapshots,
    metrics), so its name can be used again. A running job must be cancelled first."""
    res = _call(_api(etcd, api), "DELETE", _jp(job))
    out.print(f"deleted {job}" + (f" ({len(res['removed'])} paths removed)" if res["removed"] else ""))


@app.command()
def scale(
    job: Annotated[str, typer.Argument(help="Job id.")],
    rollout: Annotated[int | None, typer.Option(min=1, max=1024, help="New rollout worker count.")] = None,
    trainer: Annotated[int | None, typer.Option(min=1, max=1024, help="New trainer world size.")] = None,
    strategy: Annotated[
        Strategy | None,
        typer.Option(
            help="New trainer strategy: ddp (whole model per rank) or fsdp (sharded, FSDP2). Applied at the "
            "next step boundary from the newest snapshot + the journal, like --trainer; needs "
            "checkpoint.backend dcp."
        ),
    ] = None,
    expect: Annotated[
        list[str] | None,
        typer.Option(
            help="Compare-and-set: change only if GROUP's desired size is still N (GROUP=N, repeatable), "
            "e.g. --expect trainer=2; exit 1 naming the current size otherwise."
        ),
    ] = None,
    etcd: EtcdOpt = None,
    api: ApiOpt = None,
) -> None:
    """Change a job's group sizes or trainer strategy (desired state); the leader reconciles toward it.

    Prints the desired state as it is after the write: if another `rrl scale` raced this one
    and won, it says so (last writer wins unless --expect is given)."""
    groups = {k: v for k, v in (("rollout", rollout), ("trainer", trainer)) if v is not None}
    if not groups and strategy is None:
        fail("give --rollout N, --trainer M and/or --strategy S", 2)
    body: dict[str, Any] = dict(groups)
    if strategy is not None:
        body["strategy"] = strategy.value
    if expect:
        body["expect"] = {}
        for item in expect:
            g, sep, n = item.partition("=")
            if not sep or g not in ("rollout", "trainer") or not n.isdigit():
                fail(f"--expect: want GROUP=N with GROUP rollout or trainer, got {item!r}", 2)
            body["expect"][g] = int(n)
    res = _call(_api(etcd, api), "POST", _jp(job, "/scale"), body)
    now = res["desired"]
    out.print(f"{job}: desired now " + ", ".join(f"{g} {now.get(g)}" for g in ("rollout", "trainer"))
              + (f", strategy {now['strategy']}" if now.get("strategy") else ""))  # fmt: skip
    if strategy is not None and now.get("strategy") != strategy.value:
        out.print(f"  strategy: you asked {strategy.value}, but another request has set {now.get('strategy')} since")
    for g, n in groups.items():
        if now.get(g) != n:
            out.print(f"  {g}: you asked {n}, but another request has set {now.get(g)} since (use --expect)")


@app.command()
def events(
    job: Annotated[str, typer.Argument(help="Job id.")],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new events.")] = False,
    output: OutputOpt = "table",
    etcd: EtcdOpt = None,
    api: ApiOpt = None,
) -> None:
    """Print a job's event log (faults, recoveries, preemptions, scaling, leader changes); -f follows it."""
    _check_output(output)
    client = _api(etcd, api)
    last = -1
    while True:
        page = _call(client, "GET", _jp(job, "/events"), after=last, limit=1000)
        for e in page["events"]:
            if output == "json":
                print(json.dumps(e), flush=True)
            else:
                ts = time.strftime("%H:%M:%S", time.localtime(e["time"]))
                took = f" ({e['seconds']:.1f}s)" if isinstance(e.get("seconds"), int | float) else ""
                out.print(f"{ts} [bold]{e['kind']:<12}[/] {e['message']}{took}", highlight=False)
        last = page["next_after"]
        if len(page["events"]) == 1000:
            continue  # more pages waiting
        if not follow:
            return
        time.sleep(1.0)


_SINCE = {"s": 1, "m": 60, "h": 3600, "d": 86400}


@app.command()
def logs(
    job: Annotated[str, typer.Argument(help="Job id.")],
    group: Annotated[
        str | None,
        typer.Option(
            "--group",
            "-g",
            help="rollout or trainer (its spares included), or controller (the local platform's "
            "controllers' lines about the job); default: every worker.",
        ),
    ] = None,
    worker: Annotated[
        int | None, typer.Option("--worker", "-w", min=0, help="One worker of --group (every incarnation of it).")
    ] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines until the job ends.")] = False,
    since: Annotated[
        str | None, typer.Option("--since", help="Only lines newer than this: 30s, 10m, 2h, 1d (all of them).")
    ] = None,
    tail: Annotated[
        int, typer.Option("--tail", min=1, max=10_000, help="Without --since: how many of the newest lines.")
    ] = 200,
    timestamps: Annotated[bool, typer.Option("--timestamps", help="Prefix each line with its time.")] = False,
    etcd: EtcdOpt = None,
    api: ApiOpt = None,
) -> None:
    """Print what a job's workers wrote to stdout and stderr: tracebacks of reward functions,
    trainer errors, warnings. Each worker process captures its own output into
    <workdir>/logs/<name>.<pid>.log (rotated at 8 MB); lines of several workers are merged in
    time order and prefixed with the worker's name. Logs can hold data and secrets: reading
    them needs the controller's token (RRL_TOKEN or $RRL_HOME/token), as changes do."""
    if group is not None and group not in ("rollout", "trainer", "controller"):
        fail(f"--group must be rollout, trainer or controller, not {group!r}", 2)
    if worker is not None and group in (None, "controller"):
        fail("--worker needs --group rollout or trainer", 2)
    after: float | None = None
    if since is not None:
        m = re.fullmatch(r"(\d{1,9})([smhd])", since.strip())
        if not m:
            fail(f"--since must be a number and a unit (30s, 10m, 2h, 1d), not {since!r}", 2)
        after = time.time() - int(m[1]) * _SINCE[m[2]]
    client = _api(etcd, api)
    if group == "controller":
        _controller_logs(client, job, follow, after, tail, timestamps)
        return
    params: dict[str, Any] = {k: v for k, v in (("group", group), ("worker", worker)) if v is not None}
    first = _call(client, "GET", _jp(job, "/logs"), **params, **({"after": after, "limit": 10_000} if after is not None
                                                                else {"limit": tail}))  # fmt: skip
    if not first["exists"]:
        err.print(f"no logs yet: {first['folder']} does not exist (the job's workers capture their output there)")
    sources = {f["name"] for f in first["files"]}
    _print_log_lines(first["lines"], timestamps, prefix=len(sources) > 1 or group is None)
    after, more, quiet = first["next_after"], since is not None and len(first["lines"]) == 10_000, 0
    while follow or more:
        page = _call(client, "GET", _jp(job, "/logs"), **params, after=after or 0.0, limit=10_000)
        _print_log_lines(page["lines"], timestamps, prefix=True)
        after, more = page["next_after"], len(page["lines"]) == 10_000  # a full page: more right after it
        if more:
            continue
        if not follow:
            return
        quiet = 0 if page["lines"] else quiet + 1
        if quiet and quiet % 5 == 0:  # nothing new for a while: has the job ended?
            from controller.jobs import TERMINAL

            if _call(client, "GET", _jp(job))["state"].get("phase") in TERMINAL:
                return
        time.sleep(1.0)


_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})[ \t]")


def _controller_logs(client: Any, job: str, follow: bool, after: float | None, tail: int, timestamps: bool) -> None:
    """The lines of the local platform's controller logs ($RRL_HOME/logs/controller-*.log) that
    name ``job``, with the lines that continue them (a traceback)."""
    from .local import rrl_home

    folder = rrl_home() / "logs"
    files = sorted(folder.glob("controller-*.log"))
    if not files:
        fail(f"no controller logs in {folder}: only controllers started by `rrl up` log there (a deployed "
             "controller logs where its deployment puts its output: journald, `kubectl logs`...)")  # fmt: skip
    _call(client, "GET", _jp(job))  # the job exists (404 otherwise)
    offsets = {f: 0 for f in files}
    first, quiet = True, 0
    while True:
        lines: list[dict[str, Any]] = []
        for f in files:
            lines += _job_lines(f, job, offsets, after)
        lines.sort(key=lambda x: x["time"])
        _print_log_lines(lines[-tail:] if first and after is None else lines, timestamps, prefix=len(files) > 1)
        first = False
        if not follow:
            return
        quiet = 0 if lines else quiet + 1
        if quiet and quiet % 5 == 0:
            from controller.jobs import TERMINAL

            if _call(client, "GET", _jp(job))["state"].get("phase") in TERMINAL:
                return
        time.sleep(1.0)


def _job_lines(path: Path, job: str, offsets: dict[Path, int], after: float | None) -> list[dict[str, Any]]:
    """New complete lines of one controller log that name ``job`` (and their continuation lines)."""
    import datetime as dt

    try:
        with open(path, "rb") as f:
            f.seek(offsets[path])
            data = f.read()
    except OSError:
        return []
    end = data.rfind(b"\n") + 1
    offsets[path] += end
    out, keep, t = [], False, 0.0
    for raw in data[:end].decode("utf-8", "replace").splitlines():
        m = _LOG_TIME.match(raw)
        if m:
            t = dt.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S").timestamp() + int(m[2]) / 1000
            keep = job in raw
        if keep and (after is None or t > after):
            out.append({"time": t, "source": path.stem, "text": raw})
    return out


def _print_log_lines(lines: list[dict[str, Any]], timestamps: bool, prefix: bool) -> None:
    for x in lines:
        head = time.strftime("%H:%M:%S", time.localtime(x["time"])) + f".{int(x['time'] * 1000) % 1000:03d} " if (
            timestamps) else ""  # fmt: skip
        src = f"[{x['source']}] " if prefix else ""
        print(f"{head}{src}{x['text']}", flush=True)


@app.command()
def checkpoints(
    job: Annotated[str, typer.Argument(help="Job id.")],
    output: OutputOpt = "table",
    etcd: EtcdOpt = None,
    api: ApiOpt = None,
) -> None:
    """List a job's committed snapshots (step, size, blocking and total seconds, status)."""
    _check_output(output)
    client = _api(etcd, api)
    rows = _call(client, "GET", _jp(job, "/checkpoints"))
    if output == "json":
        out.print_json(json.dumps(rows))
        return
    if not rows:
        every = _call(client, "GET", _jp(job))["spec"].get("checkpoint", {}).get("every")
        out.print(f"{job}: no committed snapshots yet (one every {every} steps)")
        return
    print(_table(("STEP", "SIZE", "BLOCKING S", "TOTAL S", "STATUS", "PATH"),
                 [[str(c["step"]), f"{c.get('bytes', 0) / 1e6:.1f} MB", f"{c.get('blocking_s', 0):.3f}",
                   f"{c.get('seconds', 0):.2f}", c["status"], c.get("uri", "")] for c in rows]))  # fmt: skip


@app.command()
def verify(
    job: Annotated[str, typer.Argument(help="Job id (a SUCCEEDED job).")],
    etcd: EtcdOpt = None,
    ray_address: Annotated[str | None, typer.Option("--ray-address", envvar="RAY_ADDRESS")] = None,
) -> None:
    """Replay the committed journal from the initial weights in a fresh trainer; compare the
    final weights with the job's. Prints match / mismatch; exits 1 on mismatch."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from .local import Platform
    from .spec import JobSpec

    store = _store(etcd)
    rec = _call(_api(etcd), "GET", _jp(job))
    expected = rec["state"].get("weights_digest")
    if not expected:
        fail(f"{job} has no final weight digest (phase {rec['phase']}); verify runs on a SUCCEEDED job")
    spec = JobSpec.model_validate(rec["spec"])
    steps = int(rec["state"]["step"])
    ray_addr = ray_address or Platform().load().get("ray")
    from controller import jobs

    from .verify import _default_threads, describe_plan, replay_digest, replay_plan

    segments = _guard(jobs.lineage, store, job)
    plan = replay_plan(segments, steps, spec.trainer.replicas, _default_threads())
    out.print(f"{job}: {len(plan)} segment(s), each replayed as it ran (bit-exact transitions):")
    for line in describe_plan(plan):
        out.print(f"  {line}")
    with Progress(TextColumn("replaying"), BarColumn(), MofNCompleteColumn(), console=out) as bar:
        task = bar.add_task("replay", total=steps)
        try:
            actual = replay_digest(
                spec, steps, ray_addr, ",".join(store.endpoints), lambda n: bar.update(task, completed=n),
                segments=segments,
            )  # fmt: skip
        except Exception as e:  # a corrupt or missing journal file is a verification failure, said plainly
            from .errors import worker_cause

            cause = worker_cause(e)
            why = f"replay failed: {type(cause).__name__}: {str(cause).strip().splitlines()[0]}"
            out.print(f"[red]mismatch[/]: {why}")
            _guard(jobs.record_verify, store, job, {"match": False, "steps": steps, "error": why})
            raise typer.Exit(1) from None
    # kept with the job: its page and `rrl status JOB` show the newest result
    _guard(jobs.record_verify, store, job, {"match": actual == expected, "steps": steps, "segments": len(plan),
                                            "replayed": actual, "recorded": expected})  # fmt: skip
    if actual == expected:
        out.print(f"[green]match[/]: {steps} steps replayed, weights {actual[:16]}")
        return
    out.print(f"[red]mismatch[/]: replay gives {actual[:16]}, the job recorded {expected[:16]}")
    raise typer.Exit(1)


from .chaos.cli import app as chaos_app  # noqa: E402  (light: its commands import the rest lazily)

app.add_typer(chaos_app, name="chaos")  # rrl chaos run | soak | report


def _one_line_short_helps(t: typer.Typer) -> None:
    """Each command's line in a command list: its docstring's first paragraph, as one line. Typer
    kept the docstring's line breaks there, which cut `rrl --help`'s list mid-sentence."""
    for c in t.registered_commands:
        doc = inspect.getdoc(c.callback) if c.callback is not None else None
        if c.short_help is None and doc:
            c.short_help = " ".join(doc.split("\n\n", 1)[0].split())
    for g in t.registered_groups:
        if g.typer_instance is not None:
            _one_line_short_helps(g.typer_instance)


_one_line_short_helps(app)


def main() -> None:
    # Ray (started by our controllers) must bind loopback only; see docs/architecture.md
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    exit_on_sigterm()  # its clean-up runs (`rrl controller` installs its own: a clean hand-over)
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
