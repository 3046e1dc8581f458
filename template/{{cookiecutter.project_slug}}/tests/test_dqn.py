"""The DQN recipe's wiring on a tiny batch, without any distribution."""

from __future__ import annotations

import torch

from {{ cookiecutter.package_name }}.envs import make_env
from {{ cookiecutter.package_name }}.recipes import dqn
from {{ cookiecutter.package_name }}.replay import ReplayShard

from .conftest import collect_one_batch


def test_loss_writes_priorities_and_the_update_reaches_the_collector_policy():
    torch.manual_seed(0)
    env = make_env("CartPole-v1", num_envs=4, seed=0)
    agent = dqn.Agent(dqn.Config(hidden_sizes=[16], batch_size=16), env)
    frames = collect_one_batch(env, agent.policy, 64).reshape(-1)
    assert frames.batch_size == torch.Size([64])

    shard = ReplayShard(1000, alpha=0.6, beta=0.4, priority_key=agent.priority_key)
    shard.extend(frames.select(*agent.batch_keys))
    batch, _, _ = shard.sample(16)
    loss, metrics = agent(batch)
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert batch[agent.priority_key].numel() == 16

    probe = frames[:4].select("observation")  # one row per env copy, as the policy expects
    before = agent.policy(probe.clone())["action_value"].detach()
    optimizer = agent.make_optimizer()
    loss.backward()
    optimizer.step()
    after = agent.policy(probe.clone())["action_value"].detach()
    assert not torch.allclose(before, after), "the collector's policy must share the trained weights"


def test_epsilon_anneals_by_frames():
    env = make_env("CartPole-v1", num_envs=2, seed=0)
    agent = dqn.Agent(dqn.Config(eps_init=1.0, eps_end=0.1, eps_frames=100), env)
    agent.after_collect(None, 50)
    assert abs(agent.exploration.eps.item() - 0.55) < 1e-5
    agent.after_collect(None, 1000)
    assert abs(agent.exploration.eps.item() - 0.1) < 1e-6


def test_epsilon_anneals_in_closed_form_and_checkpoints_keep_it():
    env = make_env("CartPole-v1", num_envs=2, seed=0)
    config = dqn.Config(eps_init=1.0, eps_end=0.1, eps_frames=10**12)
    agent = dqn.Agent(config, env)
    # A step per frame would take hours here.
    agent.after_collect(None, 5 * 10**11)
    assert abs(agent.exploration.eps.item() - 0.55) < 1e-5
    resumed = dqn.Agent(config, env)
    resumed.load_state_dict(agent.state_dict())
    assert resumed.exploration.eps.item() == agent.exploration.eps.item()
