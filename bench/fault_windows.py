"""The job's speed in windows after each fault of chaos runs, against the 15 s before it.

``python -m bench.fault_windows RUN_DIR [RUN_DIR ...]`` reads each run's ``report.json`` (``rrl
chaos run`` / ``soak``) and prints, per fault, the commits per second over the 15 s before it and
the ratio of the rate in 0-5, 5-10, 10-15 and 15-25 s after it to that. A ratio below 1 is the
slowdown that follows a recovery (BENCHMARKS.md section 5: on 2 cores, a refill's start-up);
the first fault of a run also meets the job's own start-up (its spares warming), so compare the
later ones. Reads files only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

WINDOWS = ((0, 5), (5, 10), (10, 15), (15, 25))


def windows(report: dict) -> list[dict]:
    """Per fault: kind, the rate before it (commits/s over 15 s) and each window's ratio to it."""
    times = [s["time"] for s in report["steps"]]
    out = []
    for f in report["faults"]:
        t0 = f.get("injected_at")
        if t0 is None:
            continue

        def rate(a: float, b: float, t0: float = t0) -> float:
            return sum(1 for t in times if t0 + a <= t < t0 + b) / (b - a)

        pre = rate(-15, 0)
        out.append({"kind": f["kind"], "pre_per_s": round(pre, 2),
                    **{f"{a}-{b}s": round(rate(a, b) / pre, 2) if pre else None for a, b in WINDOWS}})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args else 2
    for d in args:
        p = Path(d) / "report.json"
        if not p.is_file():
            print(f"{d}: no report.json (a run folder of `rrl chaos run` holds one)", file=sys.stderr)
            return 2
        print(Path(d).name)
        for w in windows(json.loads(p.read_text())):
            print("  " + "  ".join(f"{k} {v}" for k, v in w.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
