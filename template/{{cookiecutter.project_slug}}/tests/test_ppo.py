"""The PPO recipe's wiring on a tiny batch, without any distribution."""

from __future__ import annotations

import pytest
import torch

from {{ cookiecutter.package_name }}.envs import make_env
from {{ cookiecutter.package_name }}.recipes import ppo

from .conftest import collect_one_batch


def make_agent_and_batch():
    torch.manual_seed(0)
    env = make_env("CartPole-v1", num_envs=4, seed=0)
    agent = ppo.Agent(ppo.Config(hidden_sizes=[16]), env)
    # 4 copies x 40 steps: several CartPole episodes end inside the batch.
    batch = collect_one_batch(env, agent.policy, 160)
    return agent, batch


def test_advantages_run_along_time_and_stop_at_episode_ends():
    agent, batch = make_agent_and_batch()
    assert batch.batch_size == (4, 40)
    agent.after_collect(batch, frames=160)
    advantage, target, value = batch["advantage"], batch["value_target"], batch["state_value"]
    assert advantage.shape == target.shape == value.shape == (4, 40, 1)
    torch.testing.assert_close(target, advantage + value)
    # Where an episode terminated, nothing is bootstrapped from the next state or the next
    # episode: the advantage is the last reward minus the value.
    ended = batch["next", "terminated"]
    assert ended.sum() >= 2
    torch.testing.assert_close(advantage[ended], (batch["next", "reward"] - value)[ended])
    # One step before the end, GAE chains exactly one step: delta_t + gamma * lambda * A_{t+1}.
    gamma, lmbda = agent.cfg.gamma, agent.cfg.gae_lambda
    env_index, step = (ended.squeeze(-1)[:, 1:]).nonzero()[0].tolist()
    reward = batch["next", "reward"][env_index, step]
    delta = reward + gamma * value[env_index, step + 1] - value[env_index, step]
    torch.testing.assert_close(
        advantage[env_index, step], delta + gamma * lmbda * advantage[env_index, step + 1]
    )


def test_one_update_trains_actor_and_critic_through_the_clipped_objective():
    agent, batch = make_agent_and_batch()
    agent.after_collect(batch, frames=160)
    minibatch = batch.reshape(-1)[:64]
    loss, priorities, metrics = agent(minibatch)
    assert priorities is None  # nothing is replayed
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert set(metrics) == {"loss_objective", "loss_critic", "entropy"}

    probe = minibatch[:4].select("observation")
    before = agent.policy(probe.clone())["logits"].detach()
    critic_before = agent.critic(probe.clone())["state_value"].detach()
    optimizers = agent.make_optimizers()
    loss.backward()
    agent.optimizer_step(optimizers, 1)  # the gradients' norm clipped, then Adam steps
    norm = torch.stack([p.grad.norm() for p in agent.parameters() if p.grad is not None]).norm()
    assert norm <= agent.cfg.max_grad_norm + 1e-6
    assert not torch.allclose(before, agent.policy(probe.clone())["logits"].detach())
    assert not torch.allclose(critic_before, agent.critic(probe.clone())["state_value"].detach())


def test_the_objective_is_the_clipped_surrogate():
    agent, batch = make_agent_and_batch()
    agent.after_collect(batch, frames=160)
    minibatch = batch.reshape(-1)[:64].clone()
    # Shift the behaviour log-probabilities both ways so that many ratios leave the clip range.
    shift = torch.linspace(-1.0, 1.0, 64).unsqueeze(-1)
    minibatch["action_log_prob"] = minibatch["action_log_prob"] + shift.squeeze(-1)
    objective = agent.loss_module(minibatch.clone())["loss_objective"]

    with torch.no_grad():
        log_prob = agent.actor.get_dist(minibatch.clone()).log_prob(minibatch["action"])
    ratio = (log_prob - minibatch["action_log_prob"]).exp()
    advantage = minibatch["advantage"].squeeze(-1)
    advantage = (advantage - advantage.mean()) / advantage.std().clamp_min(1e-6)
    epsilon = agent.cfg.clip_epsilon
    assert ((ratio < 1 - epsilon) | (ratio > 1 + epsilon)).sum() >= 16
    clipped = torch.min(ratio * advantage, ratio.clamp(1 - epsilon, 1 + epsilon) * advantage)
    torch.testing.assert_close(objective.detach(), -clipped.mean(), rtol=1e-4, atol=1e-5)


def test_the_learning_rate_falls_with_the_frames_collected_and_a_restored_agent_goes_on_from_there():
    env = make_env("CartPole-v1", num_envs=4, seed=0)
    config = ppo.Config(hidden_sizes=[16], lr=1e-3, lr_decay_frames=1000)
    agent = ppo.Agent(config, env)
    (adam,) = agent.make_optimizers().values()
    batch = collect_one_batch(env, agent.policy, 160)
    rates = []
    for _ in range(2):
        agent.after_collect(batch, frames=250)  # e.g. 2 learners' frames
        rates.append(adam.param_groups[0]["lr"])
        adam.step()
    # Each batch trains at the rate of the frames collected before it.
    assert rates == pytest.approx([1e-3, 0.75e-3])

    # As a resume does: a fresh agent and optimizer, then the saved states.
    again = ppo.Agent(config, env)
    optimizers = again.make_optimizers()
    again.load_state_dict(agent.state_dict())
    optimizers["adam"].load_state_dict(adam.state_dict())
    rates = []
    for _ in range(3):
        again.after_collect(batch, frames=250)
        rates.append(optimizers["adam"].param_groups[0]["lr"])
        optimizers["adam"].step()
    assert rates == pytest.approx([0.5e-3, 0.25e-3, 0.0])
