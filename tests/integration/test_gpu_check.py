"""bench/gpu_check.py, the script for a lent GPU machine, runs here on the CPU (--dry-run) so it cannot rot."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def test_gpu_check_dry_run_passes_every_check_it_can_run_and_says_why_it_skips_the_rest() -> None:
    r = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--dry-run"],
                       capture_output=True, text=True, timeout=300, cwd="/")  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [ln.split("|")[1:4] for ln in r.stdout.splitlines() if ln.startswith("| ") and "result" not in ln]
    results = {name.strip(): (res.strip(), detail.strip()) for name, res, detail in rows}
    passed = [n for n, (res, _) in results.items() if res == "PASS"]
    assert len(passed) == 5 and any("FSDP2" in n for n in passed) and any("DCP" in n for n in passed), results
    assert all(res in ("PASS", "SKIP") for res, _ in results.values()), results
    assert all(detail for res, detail in results.values() if res == "SKIP")  # each skip names its reason
