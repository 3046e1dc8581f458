"""The SAC recipe's wiring on a tiny batch, without any distribution; its run on MuJoCo
on two learners and a replay process."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from {{ cookiecutter.package_name }}.recipes import sac

from .conftest import family_run, pendulum_agent_and_batch


def test_actions_stay_within_the_action_space():
    _, frames, _ = pendulum_agent_and_batch(sac)
    assert frames["action"].abs().max() <= 2.0  # Pendulum's torque bound
    assert frames["action"].std() > 0.1  # the collector samples: it explores


def test_a_saturated_action_is_scored_at_the_normal_value_it_came_from():
    """An actor far out on the tanh: each action's log-probability is its pre-tanh Normal
    value's, a high density. Inverting the saturated tanh instead gave about -195,000, and
    a loss that diverged."""
    agent, frames, _ = pendulum_agent_and_batch(sac)
    last = agent.actor[0][-1]  # the MLP's output layer: each action's loc, then its scale
    with torch.no_grad():
        last.weight.zero_()
        last.bias.copy_(torch.tensor([20.0, -5.0]))
    action, log_prob = agent.sample(frames["observation"][:8])
    assert action.shape == (8, 1) and log_prob.shape == (8,)
    assert ((action - 2.0).abs() < 1e-3).all()  # Pendulum's upper bound
    assert (log_prob > 0).all(), log_prob


def test_one_update_trains_actor_critics_and_temperature_and_returns_priorities():
    agent, frames, batch = pendulum_agent_and_batch(sac)
    loss, priorities, metrics = agent(batch)
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert set(metrics) == {"loss_actor", "loss_qvalue", "alpha", "entropy"}
    assert priorities.shape == (32,) and (priorities >= 0).all()

    # The temperature is a registered parameter, so DDP all-reduces its gradient like the
    # networks' and it stays the same on every learner.
    parameters = dict(agent.named_parameters())
    assert "log_alpha" in parameters
    probe = frames[:4].select("observation")
    before_policy = agent.policy(probe.clone())["loc"].detach()
    before = {name: value.detach().clone() for name, value in parameters.items()}
    optimizers = agent.make_optimizers()
    # CleanRL's rates: the actor's, and the critics' and the temperature's.
    rates = {name: optimizer.param_groups[0]["lr"] for name, optimizer in optimizers.items()}
    assert rates == {"actor": agent.cfg.lr, "critics": agent.cfg.q_lr, "alpha": agent.cfg.q_lr}
    loss.backward()
    agent.optimizer_step(optimizers, 1)
    changed = {name for name, value in parameters.items() if not torch.equal(value, before[name])}
    assert "log_alpha" in changed
    assert any(name.startswith("actor.") for name in changed)
    assert any(name.startswith("critics.") for name in changed)
    targets = [name for name in parameters if name.startswith("target_critics.")]
    assert targets and not any(parameters[name].requires_grad for name in targets), "targets are not trained"
    after_policy = agent.policy(probe.clone())["loc"].detach()
    assert not torch.allclose(before_policy, after_policy), (
        "the collector's policy must share the trained weights"
    )


def test_target_critics_follow_the_critics_by_polyak_averaging():
    agent, _, batch = pendulum_agent_and_batch(sac)
    critics, targets = agent.critics.state_dict(), agent.target_critics.state_dict()
    for name, value in critics.items():
        torch.testing.assert_close(targets[name], value)  # they start equal
    optimizers = agent.make_optimizers()
    loss, _, _ = agent(batch)
    loss.backward()
    old_targets = {name: value.clone() for name, value in targets.items()}
    agent.optimizer_step(optimizers, 1)  # the critics step, then their targets follow
    tau = agent.cfg.tau
    for name, value in agent.critics.state_dict().items():
        torch.testing.assert_close(targets[name], (1 - tau) * old_targets[name] + tau * value)
        assert not torch.equal(targets[name], old_targets[name])


@pytest.mark.slow
def test_sac_on_mujoco_on_two_learners_trains_on_float32(tmp_path):
    summary, batch = family_run(tmp_path, "sac", "Hopper-v5", "algo.hidden_sizes=[32,32]")
    assert batch["observation"].dtype == torch.float32 and batch["observation"].shape == (4, 11)
    resolved = OmegaConf.load(tmp_path / "config.yaml")
    assert resolved.algo.lr == 3e-4 and resolved.replay.alpha == 0.0  # SAC's MuJoCo settings: uniform replay
