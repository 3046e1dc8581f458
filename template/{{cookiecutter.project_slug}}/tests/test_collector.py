"""The collector yields what torchrl's own Collector yields, only faster."""

from __future__ import annotations

import torch
from torchrl.collectors import Collector

from {{ cookiecutter.package_name }}.collector import VectorCollector, make_env
from {{ cookiecutter.package_name }}.recipes import dqn

# What the recipe trains on, and what the learner reads returns from.
KEYS = [*dqn.Agent.batch_keys, ("next", "truncated"), ("next", "episode_reward")]


def test_batches_match_torchrl_collector_step_for_step():
    # A greedy policy and the same seeds: both collectors must see the same episodes,
    # across several episode ends (CartPole ends within a few dozen random-ish steps).
    agent = dqn.Agent(dqn.Config(hidden_sizes=[16], eps_init=0.0, eps_end=0.0), make_env("CartPole-v1", 4, 0))
    frames_per_batch, total = 4 * 50, 4 * 150
    ours = VectorCollector(
        make_env("CartPole-v1", 4, seed=7), agent.policy, frames_per_batch, total, torch.device("cpu")
    )
    theirs = Collector(
        make_env("CartPole-v1", 4, seed=7),
        agent.policy,
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
