"""How fast does `rrl --help` answer? Prints the median of N runs of the real console script.

.venv/bin/python -m bench cli [N]
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from bench.common import fmt, save, summary


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    n = int(args[0]) if args else 10
    rrl = Path(sys.executable).parent / "rrl"
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run([str(rrl), "--help"], check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    ms = [t * 1000 for t in times]
    print(f"rrl --help: {fmt(ms, 0)} ms, median (min-max) over {n} runs")
    save("cli", {"runs_ms": ms, "summary_ms": summary(ms)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
