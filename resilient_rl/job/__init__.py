"""The job driver: runs in a thread of the leader controller (one runner per job).

Drives the Ray actors of :mod:`resilient_rl.workers` through small control calls; never
imports torch, vLLM or transformers at module level (the controller stays light), and
holds no tensors. Its state that matters is in etcd (fenced writes through the controller).
"""
