"""The distributed plumbing: who runs where, and what keeps the ranks together.

- ``topology.py``: roles (learners, replay processes), the learners' process group, the
  RPC world and the objects served over it;
- ``replay_processes.py``: the CPU processes rank 0 starts to host the replay shards;
- ``watchdog.py``: heartbeats, so that a dead or failed process stops the whole run, and
  stop signals passed to every rank;
- ``stragglers.py``: DD-PPO's straggler threshold, which cuts slow learners' rollouts.

The algorithm path (``learner.py``, the recipes, ``replay/``) calls into these; nothing
here knows an algorithm.
"""
