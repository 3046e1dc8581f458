"""The collector yields what torchrl's own Collector yields, only faster."""

from __future__ import annotations

import torch
from torch import nn
from torchrl.collectors import Collector
from torchrl.modules import QValueActor

from {{ cookiecutter.package_name }}.collector import VectorCollector, make_env

# What recipes train on, and what the learner reads returns from.
KEYS = [
    "observation",
    "action",
    ("next", "observation"),
    ("next", "reward"),
    ("next", "done"),
    ("next", "terminated"),
    ("next", "truncated"),
    ("next", "episode_reward"),
]


def test_batches_match_torchrl_collector_step_for_step():
    # A greedy policy and the same seeds: both collectors must see the same episodes,
    # across several episode ends (CartPole ends within a few dozen random-ish steps).
    torch.manual_seed(0)
    policy = QValueActor(
        nn.Linear(4, 2), in_keys=["observation"], spec=make_env("CartPole-v1", 4, 0).action_spec
    )
    frames_per_batch, total = 4 * 50, 4 * 150
    ours = VectorCollector(
        make_env("CartPole-v1", 4, seed=7), policy, frames_per_batch, total, torch.device("cpu")
    )
    theirs = Collector(
        make_env("CartPole-v1", 4, seed=7),
        policy,
        frames_per_batch=frames_per_batch,
        total_frames=total,
        auto_register_policy_transforms=False,
    )
    batches = list(zip(ours, theirs, strict=True))
    ours.shutdown()
    theirs.shutdown()
    assert len(batches) == 3
    for mine, reference in batches:
        assert mine.batch_size == reference.batch_size == torch.Size([4, 50])
        for key in KEYS:
            torch.testing.assert_close(mine[key], reference[key], msg=f"{key} differs")
    episode_ends = sum(int(mine["next", "done"].sum()) for mine, _ in batches)
    assert episode_ends >= 4
