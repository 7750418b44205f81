"""The RL algorithm: GRPO loss, prompt sampling, tasks and rewards. Pure code used by
the workers (and the CLI's ``rrl verify``); never imports :mod:`resilient_rl.job`."""
