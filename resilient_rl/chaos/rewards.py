"""Reward functions for chaos scenarios (``task.reward_fn: resilient_rl.chaos.rewards:copy_credit``).

Ordinary user code from the job's point of view: the harness injects ``reward_hang`` from
outside by creating a flag file in the run folder (``$RRL_CHAOS_DIR``, which the platform
it starts hands down to every Ray worker); while it exists every call hangs, as a user's
function stuck on a network call or a deadlock would. Nothing in rrl itself knows of it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from resilient_rl.algo.tasks.rewards import positional_credit


def copy_credit(prompt: str, completion: str, answer: str) -> float:
    """Per-character credit of ``completion`` against ``answer``; hangs while the harness's flag is set."""
    chaos = os.environ.get("RRL_CHAOS_DIR")
    while chaos and (Path(chaos) / "reward-hang").exists():
        time.sleep(0.2)
    return positional_credit(answer, completion)
