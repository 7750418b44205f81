"""The job's Ray actors: rollout workers (vLLM / HF engines), trainer ranks (torch),
the weight store. Each runs in its own Ray worker process; never imports
:mod:`resilient_rl.job` (the driver calls them, not the other way round)."""
