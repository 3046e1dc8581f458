"""Recipes tested in place, as the plain Python files the hook copies into projects."""

from __future__ import annotations

import dataclasses
import importlib

import gymnasium as gym
import pytest
import torch
from torchrl.envs import GymWrapper

from .conftest import REPO

RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.py") if not p.stem.startswith("_"))
ENV_FOR = {"dqn": "CartPole-v1"}


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_follows_the_interface_and_its_loss_trains(name):
    recipe = importlib.import_module(f"recipes.{name}")
    assert dataclasses.is_dataclass(recipe.Config)
    env = GymWrapper(
        gym.make_vec(
            ENV_FOR[name],
            num_envs=2,
            vectorization_mode="sync",
            vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
        )
    )
    agent = recipe.Agent(recipe.Config(), env)
    assert isinstance(agent, torch.nn.Module)
    for attribute in ("uses_replay", "batch_keys", "priority_key", "policy"):
        assert hasattr(agent, attribute), attribute

    batch = env.rollout(16, agent.policy).reshape(-1).select(*agent.batch_keys)
    batch["priority_weight"] = torch.ones(batch.shape)
    loss, metrics = agent(batch)
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
    optimizer = agent.make_optimizer()
    before = [p.detach().clone() for p in agent.parameters()]
    loss.backward()
    optimizer.step()
    agent.after_update()
    agent.after_collect(16)
    assert any(not torch.equal(a, b) for a, b in zip(before, agent.parameters(), strict=True))
