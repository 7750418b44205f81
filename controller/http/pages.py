"""Server-rendered HTML of the status page (templates in ``controller/web/templates``).

Every value is HTML-escaped here; the initial view is embedded as JSON with
``<`` escaped, so nothing from etcd (a job name, an event message) can close the
script element. The page's script (``web/static/app.js``) keeps it live.
"""

from __future__ import annotations

import html
import json
from functools import cache
from pathlib import Path
from string import Template
from typing import Any

TEMPLATES = Path(__file__).resolve().parent.parent / "web" / "templates"


@cache
def _template(name: str) -> Template:
    return Template((TEMPLATES / name).read_text())


def _e(x: Any) -> str:
    return html.escape("-" if x is None else str(x), quote=True)


def _num(x: Any, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.1f}h"


def index(rows: list[dict[str, Any]], served_by: str | None) -> str:
    out = []
    for j in rows:
        out.append(
            f'<tr data-job="{_e(j["id"])}"><td><a href="/jobs/{_e(j["id"])}">{_e(j["id"])}</a></td>'
            f'<td><span class="phase phase-{_e(j["phase"])}">{_e(j["phase"])}</span></td>'
            f"<td>{_e(j['step'])} / {_e(j['steps'])}</td>"
            f'<td><div class="bar"><div style="width: {100 * float(j["progress"]):.1f}%"></div></div></td>'
            f"<td>{_num(j['reward'], 3)}</td><td>{_age(j['age_s'])}</td>"
            f"<td>{_e(j['failures'])}</td><td>{_e(j['recoveries'])}</td></tr>"
        )
    return _template("index.html").substitute(
        rows="\n".join(out), served_by=_e(served_by), empty_hidden=" hidden" if rows else ""
    )


def job(view: dict[str, Any]) -> str:
    s = view["summary"]
    initial = json.dumps(view).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return _template("job.html").substitute(
        job=_e(s["id"]),
        phase=_e(s["phase"]),
        reason=_e(s["reason"] or ""),
        reason_hidden="" if s["reason"] else " hidden",
        leader=_e(view["leader"] or "none"),
        served_by=_e(view["served_by"]),
        step=_e(s["step"]),
        steps=_e(s["steps"]),
        percent=f"{100 * float(s['progress']):.1f}",
        policy=_e(s["policy_version"]),
        reward=_num(s["reward"], 3),
        tps=_num(s["tokens_per_s"], 0),
        failures=_e(s["failures"]),
        recoveries=_e(s["recoveries"]),
        preemptions=_e(s["preemptions"]),
        want_rollout=_e(s["desired"].get("rollout") or 1),
        want_trainer=_e(s["desired"].get("trainer") or 1),
        initial=initial,
    )
