"""The chaos report: ``report.json`` (everything), ``report.md`` (timeline, a table per fault,
MTTR per kind, goodput, invariants) and ``progress.svg`` (committed steps over time, faults
marked), written by hand: no plotting dependency."""

from __future__ import annotations

import html
import json
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, ValidationError

_COLORS = ["#d62728", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#1f77b4", "#2ca02c"]


def write(rep: dict[str, Any], run_dir: Path) -> dict[str, Path]:
    """Write the three files into ``run_dir``; returns their paths."""
    run_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": run_dir / "report.json", "md": run_dir / "report.md", "svg": run_dir / "progress.svg"}
    paths["json"].write_text(json.dumps(rep, indent=1, default=str))
    paths["svg"].write_text(svg(rep))
    paths["md"].write_text(markdown(rep))
    return paths


def load(run: str | Path) -> dict[str, Any]:
    """A run's report from its folder or its report.json. Raises ValueError naming the first
    field whose shape the report's renderers cannot take (a file edited by hand, another file)."""
    p = Path(run)
    if p.is_dir():
        p = p / "report.json"
    rep = json.loads(p.read_text())
    try:  # its defaults filled in, every field kept
        return _Report.model_validate(rep).model_dump()
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "the file"
        raise ValueError(f"{p} is not a chaos report: {where}: {first['msg']}") from None


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Job(_Open):
    steps: int | None = None
    started_at: float | None = None


class _Figures(_Open):
    detection_s: float | None = None
    next_commit_s: float | None = None
    recovered_s: float | None = None
    group_restored_s: float | None = None


class _Fault(_Open):
    id: int | str
    kind: str
    status: str = "?"
    injected_at: float | None = None
    ended_at: float | None = None
    figures: _Figures = _Figures()


class _Invariant(_Open):
    number: int
    name: str
    ok: StrictBool
    details: list[str] = []


class _Step(_Open):
    step: int
    time: float


class _Point(_Open):
    t: float
    step: int


class _Mttr(_Open):
    count: int
    mean_detection_s: float | None = None
    mean_next_commit_s: float | None = None
    mean_recovered_s: float | None = None
    mean_group_restored_s: float | None = None


class _Report(_Open):
    """A report's shape as far as :func:`markdown`, :func:`svg` and the CLI's summary read it;
    fields beyond it are kept."""

    scenario: str
    ok: StrictBool
    job: _Job
    faults: list[_Fault] = []
    invariants: list[_Invariant] = []
    mttr: dict[str, _Mttr] = {}
    goodput: dict[str, Any] = {}
    lost_work: dict[str, Any] = {}
    events: list[dict[str, Any]] = []
    timeline: list[_Point] = []
    steps: list[_Step] = []


def _t0(rep: dict[str, Any]) -> float:
    cands = [rep.get("job", {}).get("started_at")] + [s["t"] for s in rep.get("timeline", [])[:1]]
    return (
        min(float(c) for c in cands if isinstance(c, int | float))
        if any(isinstance(c, int | float) for c in cands)
        else 0.0
    )


def _fmt(x: Any, unit: str = "s") -> str:
    return "-" if x is None else f"{x:.2f}{unit}" if isinstance(x, float) else f"{x}{unit}"


def markdown(rep: dict[str, Any]) -> str:
    t0 = _t0(rep)
    job = rep.get("job", {})
    g = rep.get("goodput", {})
    lines = [
        f"# Chaos run: {rep.get('scenario')}",
        "",
        f"**{'PASS' if rep.get('ok') else 'FAIL'}**: job `{job.get('id')}` ended {job.get('phase')} at step "
        f"{job.get('step')}/{job.get('steps')}"
        + (f" ({job['reason']})" if job.get("reason") else "")
        + f"; run wall {rep.get('wall_s', '?')} s; folder `{rep.get('run_dir', '')}`.",
        "",
        "![progress](progress.svg)",
        "",
        "## Invariants",
        "",
        "| # | invariant | result | details |",
        "|---|---|---|---|",
    ]
    for inv in rep.get("invariants", []):
        det = "; ".join(inv.get("details", []))[:400].replace("|", "\\|")
        lines.append(f"| {inv['number']} | {inv['name']} | {'ok' if inv['ok'] else '**FAIL**'} | {det} |")
    lines += [
        "",
        "## Goodput and lost work",
        "",
        f"- ETTR (training phase): **{_fmt(g.get('ettr'), '')}** = {g.get('committed_steps')} steps x "
        f"{_fmt(g.get('fault_free_step_s'))} fault-free step / {_fmt(g.get('wall_s'))} wall",
        f"- ETTR including start-up: {_fmt(g.get('ettr_total'), '')} (wall {_fmt(g.get('wall_total_s'))})",
        f"- ETTR between the first and the last fault: {_fmt(g.get('ettr_window'), '')} "
        f"({g.get('window_faults', 0)} fault intervals, {_fmt(g.get('window_s'))})",
    ]
    for k, v in rep.get("lost_work", {}).items():
        lines.append(f"- {k.replace('_', ' ')}: {v}")
    lines += ["", "## MTTR per fault kind (mean seconds after injection)", "",
              "| kind | n | detection | next commit | recovery event | group size restored |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for kind, row in rep.get("mttr", {}).items():
        lines.append(
            f"| {kind} | {row['count']} | {_fmt(row['mean_detection_s'])} | {_fmt(row['mean_next_commit_s'])} | "
            f"{_fmt(row['mean_recovered_s'])} | {_fmt(row['mean_group_restored_s'])} |"
        )
    lines += ["", "## Faults", ""]
    for f in rep.get("faults", []):
        fig = f.get("figures", {})
        at = f.get("injected_at")
        lines += [
            f"### {f['id']}. {f['kind']} ({f.get('status')})",
            "",
            "| field | value |",
            "|---|---|",
            f"| scheduled | {json.dumps(f.get('at'))} |",
            f"| injected | {'-' if at is None else f't+{at - t0:.1f}s'} |",
            f"| lasted | {_fmt(None if at is None or not f.get('ended_at') else round(f['ended_at'] - at, 2))} |",
            f"| target | `{json.dumps(f.get('target', {}))}` |",
            f"| detection | {_fmt(fig.get('detection_s'))} ({fig.get('detected_by', '-')}) |",
            f"| next committed step | {_fmt(fig.get('next_commit_s'))} |",
            f"| recovery event | {_fmt(fig.get('recovered_s'))} ({fig.get('recovered_by', '-')}) |",
            f"| back to desired group size | {_fmt(fig.get('group_restored_s'))} |",
        ]
        if f.get("note"):
            lines.append(f"| note | {str(f['note']).replace('|', '/')} |")
        lines.append("")
    lines += ["## Timeline", "", "| t | what |", "|---|---|"]
    rows: list[tuple[float, str]] = []
    for f in rep.get("faults", []):
        if f.get("injected_at"):
            rows.append((f["injected_at"], f"**fault {f['id']}: {f['kind']}** injected"))
    for e in rep.get("events", []):
        if isinstance(e.get("time"), int | float) and e.get("kind") != "snapshot":
            rows.append((e["time"], f"{e.get('kind')}: {str(e.get('message', ''))[:160]}".replace("|", "/")))
    for t, what in sorted(rows):
        lines.append(f"| t+{t - t0:.1f}s | {what} |")
    lines += ["", f"_generated {time.strftime('%Y-%m-%d %H:%M:%S')}_", ""]
    return "\n".join(lines)


def svg(rep: dict[str, Any], width: int = 900, height: int = 360) -> str:
    """Committed steps over time, each fault a coloured band from injection to its end."""
    t0 = _t0(rep)
    pts = [(float(s["time"]) - t0, int(s["step"]) + 1) for s in rep.get("steps", []) if "time" in s]
    if not pts:
        pts = [(float(s["t"]) - t0, int(s["step"])) for s in rep.get("timeline", [])]
    faults = [f for f in rep.get("faults", []) if f.get("injected_at")]
    tmax = max([p[0] for p in pts] + [(f.get("ended_at") or f["injected_at"]) - t0 for f in faults] + [1.0])
    smax = max([p[1] for p in pts] + [int(rep.get("job", {}).get("steps") or 1)])
    ml, mr, mt, mb = 55, 20, 20, 45
    w, h = width - ml - mr, height - mt - mb

    def x(t: float) -> float:
        return ml + w * max(0.0, t) / tmax

    def y(s: float) -> float:
        return mt + h * (1 - s / smax)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="11">',
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="white"/>',
    ]
    for i, f in enumerate(faults):
        c = _COLORS[i % len(_COLORS)]
        a, b = x(f["injected_at"] - t0), x((f.get("ended_at") or f["injected_at"]) - t0)
        out.append(f'<rect x="{a:.1f}" y="{mt}" width="{max(b - a, 1.5):.1f}" height="{h}" fill="{c}" '
                   f'fill-opacity="0.25"><title>{html.escape(f["kind"])}</title></rect>')  # fmt: skip
        out.append(f'<line x1="{a:.1f}" y1="{mt}" x2="{a:.1f}" y2="{mt + h}" stroke="{c}" stroke-width="1.5"/>')
        out.append(f'<text x="{a + 2:.1f}" y="{mt + 12 + 12 * (i % 6)}" fill="{c}">{html.escape(f["kind"])}</text>')
    if pts:
        path = " ".join(f"{x(t):.1f},{y(s):.1f}" for t, s in sorted(pts))
        out.append(f'<polyline points="{path}" fill="none" stroke="#1f77b4" stroke-width="2"/>')
    out.append(f'<line x1="{ml}" y1="{mt + h}" x2="{ml + w}" y2="{mt + h}" stroke="black"/>')
    out.append(f'<line x1="{ml}" y1="{mt}" x2="{ml}" y2="{mt + h}" stroke="black"/>')
    for i in range(6):
        t, s = tmax * i / 5, smax * i / 5
        out.append(f'<text x="{x(t):.1f}" y="{mt + h + 15}" text-anchor="middle">{t:.0f}</text>')
        out.append(f'<text x="{ml - 5}" y="{y(s) + 4:.1f}" text-anchor="end">{s:.0f}</text>')
    out.append(f'<text x="{ml + w / 2}" y="{height - 8}" text-anchor="middle">seconds since the job started</text>')
    out.append(f'<text x="14" y="{mt + h / 2}" transform="rotate(-90 14 {mt + h / 2})" text-anchor="middle">'
               "committed steps</text>")  # fmt: skip
    out.append("</svg>")
    return "\n".join(out) + "\n"
