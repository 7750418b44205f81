"""The chaos-test harness: scenarios, fault injectors, invariant checks, MTTR/ETTR report.

::

    scenario.yaml ──▶ ChaosCluster (etcd ×1|3, Ray nodes, controllers; own $RRL_HOME)
                           │ submit job
                           ▼
     schedule ──▶ injectors (signals, kills, etcd stop, file damage, tmpfs ballast)
                           │              ▲ pids from etcd membership / controller
                           ▼              │ registrations / the cluster's own records
     monitor (state, members, journal) ──▶ artefacts (etcd history, events, journal,
                                           checkpoints, replay digest)
                                                   │
                                                   ▼
                          invariants.py (pure) + measure.py (pure) ──▶ report.json / .md / .svg

Faults come from outside the processes only: nothing in the production code
knows it is being tested. Light to import: the heavy parts (Ray, torch) are
imported inside :mod:`.harness` when a run needs them.
"""
