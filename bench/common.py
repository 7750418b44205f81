"""Shared pieces of the benchmarks: figures as median (min-max), the machine line, results
files, and an isolated local platform to run rrl jobs on.

Every section writes ``bench/results/{section}.json`` (machine, date, command, raw runs,
summaries) and prints Markdown tables; BENCHMARKS.md quotes those tables.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def summary(values: Sequence[float]) -> dict[str, float]:
    """``{median, min, max, n}`` of repeated measurements."""
    vals = [float(v) for v in values]
    if not vals:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def fmt(values: Sequence[float] | dict[str, float], digits: int = 2) -> str:
    """``median (min-max)``, the way every figure in BENCHMARKS.md is shown."""
    s = values if isinstance(values, dict) else summary(values)
    if not s["n"]:
        return "-"
    if s["n"] == 1:
        return f"{s['median']:.{digits}f}"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def machine() -> dict[str, Any]:
    """Cores, memory, CPU model, load, versions: printed with and stored beside every figure."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    info: dict[str, Any] = {
        "cores": os.cpu_count(),
        "mem_gib": round(mem_gib, 1),
        "cpu": cpu,
        "python": platform.python_version(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    return info


def machine_line(m: dict[str, Any] | None = None) -> str:
    m = m or machine()
    return (
        f"{m['cores']} cores ({m['cpu']}), {m['mem_gib']} GiB, Python {m['python']}"
        + (f", torch {m['torch']}" if "torch" in m else "")
        + f"; load average {m['load_avg'][0]} at start; {m['date']}"
    )


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in [".venv/bin/python", "-m", "bench", *sys.argv[1:]])


def save(section: str, data: dict[str, Any]) -> Path:
    """Write ``bench/results/{section}.json`` (with the machine and the command) and return its path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{section}.json"
    payload = {"section": section, "command": command_line(), "machine": machine(), **data}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


@contextmanager
def local_platform(home: Path, progress: Any = print) -> Iterator[tuple[dict[str, Any], Any]]:
    """An rrl platform (etcd, Ray head, one controller) in its own ``home``, stopped at the end.

    Yields ``(platform record, API client)``. ``RRL_HOME`` is set for the duration so the
    controller's jobs write under ``home``.
    """
    from controller.http.client import ApiClient
    from controller.store import Store
    from resilient_rl.local import Platform, read_token

    old = os.environ.get("RRL_HOME")
    os.environ["RRL_HOME"] = str(home)
    plat = Platform(home)
    try:
        data = plat.up(progress=progress)
        store = Store(data["etcd"])
        deadline = time.monotonic() + 120
        while True:
            client = ApiClient.discover(store, read_token(home), lambda: None)
            if client.urls:
                try:
                    client.get("/api/v1/jobs")
                    break
                except Exception:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the controller did not answer within 120 s (logs in {home / 'logs'})")
            time.sleep(0.5)
        yield data, client
    finally:
        plat.down(progress=lambda *_: None)
        if old is None:
            os.environ.pop("RRL_HOME", None)
        else:
            os.environ["RRL_HOME"] = old


def run_job(client: Any, spec: dict[str, Any], timeout: float = 3600.0, progress: Any = print) -> dict[str, Any]:
    """Submit ``spec`` through the API and wait for a terminal phase; returns the job record."""
    from controller.jobs import TERMINAL

    client.post("/api/v1/jobs", {"spec": spec})
    deadline = time.monotonic() + timeout
    last = -1
    while True:
        rec = client.get(f"/api/v1/jobs/{spec['name']}")
        step = int(rec.get("state", {}).get("step", 0))
        if step // 50 != last // 50:
            progress(f"  {spec['name']}: {rec['phase']} step {step}/{spec.get('steps')}")
            last = step
        if rec["phase"] in TERMINAL:
            return dict(rec)
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {spec['name']} still {rec['phase']} after {timeout:.0f} s")
        time.sleep(0.5)


def job_metrics(home: Path, name: str) -> list[dict[str, Any]]:
    """The rows of ``{home}/jobs/{name}/metrics.jsonl`` (one per committed step)."""
    from controller import steplog

    return steplog.read(home / "jobs" / name / "metrics.jsonl")
