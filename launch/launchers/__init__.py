"""Launchers: how a training job's processes are started and supervised (`run.launcher`): on this
machine (local.py), the learner's ranks under torchrun on one node or several (torchrun.py), or a
Ray cluster (ray.py); one interface and one supervision loop (supervise.py)."""
