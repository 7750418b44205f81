"""`python -m bench SECTION [options]`: run one benchmark section, or `all` of them.

Sections (each is ``bench/<module>.py`` with ``main(argv) -> int``; ``--help`` on any shows its
options). Every section prints its tables and writes ``bench/results/<section>.json``:

  overhead      bare GRPO loop vs rrl (max_staleness 0 and 1), tiny and ~1 s/step sizes
  peer          TRL GRPOTrainer vs rrl (vLLM and HF engines) on the copy task (needs `.[bench]`)
  checkpoint    snapshot blocking time vs the memcpy floor and torch.save (DCP, torchsnapshot)
  weight-sync   seconds to bring 1/2/4 rollout workers to a new version, 0.3M and >= 100M params
  recovery      MTTR per fault kind and ETTR from chaos soaks at one fault per 30 s and per 60 s
  scale         controller + etcd with 1,000 / 5,000 simulated workers: detection p50/p99, CPU, req/s
  cli           `rrl --help` start-up time
  sharded       DDP vs FSDP2 at world 2, ~105M params: peak memory per rank, step time, publish time
  lora          full training vs LoRA on one model: snapshot, shadow and weight-sync bytes, step time
  balance       long-tail rollouts: shard-level vs small shards vs work stealing; generation lost per kill

`make bench` runs `all` (about two hours on 2 cores); figures go into BENCHMARKS.md by hand.
"""

from __future__ import annotations

import importlib
import sys
import time

SECTIONS = {
    "overhead": "bench.overhead",
    "peer": "bench.peer_trl",
    "checkpoint": "bench.checkpoint_stall",
    "weight-sync": "bench.weight_sync",
    "recovery": "bench.recovery",
    "scale": "bench.controller_scale",
    "cli": "bench.cli_startup",
    "sharded": "bench.sharded",
    "lora": "bench.lora",
    "balance": "bench.rollout_balance",
}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name == "all":
        if rest:
            print("`all` runs every section with its defaults; pass options to one section instead", file=sys.stderr)
            return 2
        failed = []
        for section in SECTIONS:
            print(f"\n=== {section} ===", flush=True)
            t0 = time.monotonic()
            rc = importlib.import_module(SECTIONS[section]).main([])
            print(f"=== {section}: exit {rc} after {time.monotonic() - t0:.0f} s ===", flush=True)
            if rc:
                failed.append(section)
        if failed:
            print(f"failed sections: {', '.join(failed)}", file=sys.stderr)
        return 1 if failed else 0
    if name not in SECTIONS:
        print(f"unknown section {name!r}; one of: {', '.join(SECTIONS)}, all", file=sys.stderr)
        return 2
    return int(importlib.import_module(SECTIONS[name]).main(rest) or 0)


if __name__ == "__main__":
    from resilient_rl.signals import exit_on_sigterm

    exit_on_sigterm()  # a section's clean-up (the platforms and soaks it started) runs at SIGTERM
    sys.exit(main())
