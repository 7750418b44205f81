"""How fast does `rrl --help` answer? Prints the median of N runs of the real console script.

.venv/bin/python bench/cli_startup.py [N]
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    rrl = Path(sys.executable).parent / "rrl"
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run([str(rrl), "--help"], check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    print(f"rrl --help: median {statistics.median(times) * 1000:.0f} ms, max {max(times) * 1000:.0f} ms over {n} runs")


if __name__ == "__main__":
    main()
