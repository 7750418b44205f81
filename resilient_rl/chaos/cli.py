"""``rrl chaos``: run a scenario, a random soak, or re-render a run's report.

Light at import (typer and rich only): ``rrl --help`` must not pull in Ray or
torch; every command imports what it needs when it runs.

Exit codes: 0 all invariants held and every fault was injected, 1 an invariant
failed or a fault could not be injected, 2 a bad scenario / option.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

app = typer.Typer(
    name="chaos",
    help="Chaos tests: inject faults into a job on a platform of their own, check the invariants, report MTTR/ETTR.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# soft wrap: a long line (a path, an error) stays one line when piped to grep or a file; a
# terminal wraps it for the eye. Tables are laid out to the width as before.
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

OutOpt = Annotated[Path, typer.Option("--out", help="Folder for run folders (one per run).")]
KeepOpt = Annotated[bool, typer.Option("--keep", help="Leave the platform running after the run (stop it by PID).")]


def parse_duration(text: str) -> float:
    """``"90"``, ``"30s"``, ``"5m"``, ``"1h"``, ``"1h30m"`` -> seconds. Raises ValueError."""
    t = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", t):
        return float(t)
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*(h|m|s)", t)
    if not parts or "".join(f"{n}{u}" for n, u in parts) != t.replace(" ", ""):
        raise ValueError(f"{text!r} is not a duration (use e.g. 90, 30s, 5m, 1h)")
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


def _positive(option: str, text: str) -> float:
    """A duration option, more than 0 seconds. Raises ValueError naming the option."""
    try:
        s = parse_duration(text)
    except ValueError as e:
        raise ValueError(f"{option}: {e}") from None
    if s <= 0:
        raise ValueError(f"{option}: {text!r} must be more than 0 seconds")
    return s


def _check_job(sc: Any, path: Any, label: str) -> None:
    """The scenario's job checked before any platform starts (the run checks it again, with its
    folder): a bad job exits 2 naming its field."""
    from ..spec import SpecError, parse_spec
    from .scenario import ScenarioError, job_spec_dict

    try:
        parse_spec(job_spec_dict(sc, path), label)
    except (SpecError, ScenarioError) as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False)
        raise typer.Exit(2) from None


def _summary(rep: dict[str, Any]) -> int:
    from rich.table import Table

    t = Table(box=None, header_style="bold", title=f"faults ({rep.get('scenario')})")
    for col in ("#", "KIND", "STATUS", "DETECT S", "NEXT COMMIT S", "RECOVERED S", "GROUP OK S"):
        t.add_column(col, no_wrap=True)
    t.add_column("NOTE", overflow="ellipsis", no_wrap=True, min_width=16)
    for f in rep.get("faults", []):
        fig = f.get("figures", {})
        t.add_row(str(f["id"]), f["kind"], f.get("status", "?"),
                  *[("-" if fig.get(k) is None else f"{fig[k]:.1f}") for k in
                    ("detection_s", "next_commit_s", "recovered_s", "group_restored_s")],
                  str(f.get("note", ""))[:60])  # fmt: skip
    out.print(t)
    for inv in rep.get("invariants", []):
        mark = "[green]ok[/]  " if inv["ok"] else "[red]FAIL[/]"
        out.print(f"{mark} {inv['number']}. {inv['name']}: {'; '.join(inv['details'])[:300]}", highlight=False)
    g = rep.get("goodput", {})
    window = f"; {g['ettr_window']} between the first and last fault" if g.get("ettr_window") is not None else ""
    out.print(f"ETTR {g.get('ettr')} (with start-up {g.get('ettr_total')}{window}); lost work {rep.get('lost_work')}")
    job = rep.get("job", {})
    out.print(f"job {job.get('id')} {job.get('phase')} at step {job.get('step')}/{job.get('steps')}")
    out.print(f"report: {rep.get('run_dir')}/report.md")
    bad = [f for f in rep.get("faults", []) if f.get("status") != "injected"]
    ok = bool(rep.get("ok")) and not bad
    out.print("[green]PASS[/]" if ok else "[red]FAIL[/]" + (f" ({len(bad)} faults not injected)" if bad else ""))
    return 0 if ok else 1


def _run(sc: Any, path: Any, out_dir: Path, keep: bool) -> None:
    import logging

    from .harness import run_scenario

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rep = run_scenario(sc, out_dir, path, progress=out.print, keep=keep)
    raise typer.Exit(_summary(rep))


@app.command()
def run(
    scenario: Annotated[Path, typer.Argument(help="Scenario file (YAML). See scenarios/.")],
    out_dir: OutOpt = Path("chaos-runs"),
    keep: KeepOpt = False,
) -> None:
    """Run one scenario: start a platform, run the job under the fault schedule, check, report."""
    from .scenario import ScenarioError, load_scenario

    try:
        sc = load_scenario(scenario)
    except ScenarioError as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False)
        raise typer.Exit(2) from None
    _check_job(sc, scenario, f"{scenario}: job")
    _run(sc, scenario, out_dir, keep)


@app.command()
def soak(
    duration: Annotated[str, typer.Option(help="How long faults are injected (e.g. 30m, 1h).")] = "30m",
    mtbf: Annotated[str, typer.Option(help="Mean time between faults (e.g. 30s).")] = "30s",
    seed: Annotated[int, typer.Option(help="Seed of the random schedule.")] = 0,
    scenario: Annotated[Path, typer.Option(help="Base scenario (cluster, job, fault kinds).")] = Path(
        "scenarios/soak.yaml"
    ),
    steps: Annotated[int | None, typer.Option(help="Override the job's step count.")] = None,
    out_dir: OutOpt = Path("chaos-runs"),
    keep: KeepOpt = False,
) -> None:
    """Random faults (exponential gaps, mixed kinds, fixed seed) for a duration, then the job must finish."""
    from .scenario import ScenarioError, job_spec_dict, load_scenario, parse_scenario

    try:
        dur, gap = _positive("--duration", duration), _positive("--mtbf", mtbf)
        base = load_scenario(scenario)
        r = base.random.model_dump() if base.random is not None else {}
        start = r.get("start_s", 20.0)
        job = job_spec_dict(base, scenario)
        if steps is not None:
            job = {**job, "steps": steps}
        # validated again as a whole: the options are bounded as the file's fields are
        sc = parse_scenario(
            {**base.model_dump(), "random": {**r, "mtbf_s": gap, "seed": seed, "start_s": start, "stop_s": start + dur},
             "job": job, "job_file": None, "name": f"{base.name}-s{seed}",
             "timeout_s": max(base.timeout_s, dur + base.settle_timeout_s + 600)},
            f"{scenario} with --duration {duration} --mtbf {mtbf}" + (f" --steps {steps}" if steps is not None else ""),
        )  # fmt: skip
    except (ValueError, ScenarioError) as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False)
        raise typer.Exit(2) from None
    _check_job(sc, scenario, f"{scenario}: job" + (f" (steps from --steps {steps})" if steps is not None else ""))
    out.print(f"soak: {len(sc.schedule())} faults over {dur:g}s (mtbf {gap:g}s, seed {seed})")
    _run(sc, scenario, out_dir, keep)


@app.command()
def report(run_dir: Annotated[Path, typer.Argument(help="A run folder (or its report.json).")]) -> None:
    """Re-render a run's Markdown report and plot from its report.json and print the summary."""
    from . import report as rep_mod

    try:
        rep = rep_mod.load(run_dir)
    except (OSError, ValueError) as e:
        err.print(f"[bold red]error:[/] cannot read a report from {run_dir}: {e}", highlight=False)
        raise typer.Exit(2) from None
    folder = run_dir if run_dir.is_dir() else run_dir.parent
    rep_mod.write(rep, folder)
    raise typer.Exit(_summary(rep))
