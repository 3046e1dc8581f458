"""The TD3 recipe's wiring on a tiny batch, without any distribution."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torchrl.envs.utils import ExplorationType, set_exploration_type

from {{ cookiecutter.package_name }}.graphs import GraphedGradients
from {{ cookiecutter.package_name }}.recipes import td3

from .conftest import pendulum_agent_and_batch


def test_the_collector_explores_around_the_actor_and_evaluation_does_not():
    agent, frames, _ = pendulum_agent_and_batch(td3)
    assert frames["action"].abs().max() <= 2.0  # Pendulum's torque bound
    probe = frames[:16].select("observation")
    with set_exploration_type(ExplorationType.DETERMINISTIC):
        greedy = agent.policy(probe.clone())["action"]
    torch.testing.assert_close(greedy, agent.actor(probe.clone())["action"])
    noisy = agent.policy(probe.clone())["action"]  # the collector's (random) mode
    # Noise of 0.1 half-ranges (0.2 for Pendulum's [-2, 2]), clipped to the bounds.
    assert 0.05 < (noisy - greedy).std() < 0.4


def step(agent, optimizers, batch, update: int) -> tuple[dict, list[torch.Tensor]]:
    """One update as the learner runs it: its path, every gradient, then the recipe's
    optimizers. Returns its metrics and the actor's gradients."""
    agent.update_path(update)
    loss, _, metrics = agent(batch.clone())
    for optimizer in optimizers.values():
        optimizer.zero_grad(set_to_none=True)
    loss.backward()
    gradients = [p.grad.clone() for p in agent.actor.parameters()]
    agent.optimizer_step(optimizers, update)
    return metrics, gradients


def snapshot(agent) -> list[torch.Tensor]:
    """The actor, the critics, the target actor and the target critics, each flattened."""
    parts = (agent.actor, agent.critics, agent.target_actor, agent.target_critics)
    return [torch.cat([p.detach().reshape(-1) for p in part.parameters()]).clone() for part in parts]


def test_the_actor_and_the_targets_move_every_second_update_and_the_critics_at_every_one():
    agent, _, batch = pendulum_agent_and_batch(td3)
    optimizers = agent.make_optimizers()
    moved, actor_losses, zero_gradients = [], [], []
    for update in (1, 2, 3, 4):
        before = snapshot(agent)
        metrics, gradients = step(agent, optimizers, batch, update)
        moved.append(tuple(not torch.equal(b, a) for b, a in zip(before, snapshot(agent), strict=True)))
        actor_losses.append("loss_actor" in metrics)
        zero_gradients.append(all(not g.any() for g in gradients))
    # (actor, critics, target actor, target critics) at updates 1-4. On critic-only updates
    # the actor had a gradient (DDP all-reduced it) and Adam state, yet did not move.
    assert moved == [
        (False, True, False, False),
        (True, True, True, True),
        (False, True, False, False),
        (True, True, True, True),
    ]
    # Its loss is taken over the batch where it learns, and over no transitions where it
    # does not: a gradient of zeros, nothing logged.
    assert actor_losses == [False, True, False, True]
    assert zero_gradients == [True, False, True, False]


def test_priorities_are_the_larger_absolute_td_error_of_the_twin_critics():
    """TD3's target (Fujimoto et al., 2018): the smaller target critic's value of the
    target actor's action plus clipped noise, bootstrapped unless the episode terminated."""
    agent, _, batch = pendulum_agent_and_batch(td3)
    cfg = agent.cfg
    torch.manual_seed(1)
    _, priorities, _ = agent(batch.clone())
    torch.manual_seed(1)  # the same target-policy smoothing noise
    noise = (torch.randn_like(batch["action"]) * cfg.policy_noise).clamp(-cfg.noise_clip, cfg.noise_clip)
    with torch.no_grad():
        next_action = agent.target_actor(batch["next"].select("observation").clone())["action"]
        next_action = (next_action + noise).clamp(-2.0, 2.0)  # Pendulum's torque bound
        next_input = torch.cat([batch["next", "observation"], next_action], -1)
        next_q = torch.min(*(target(next_input) for target in agent.target_critics)).squeeze(-1)
        bootstrap = ~batch["next", "terminated"].squeeze(-1)
        target = batch["next", "reward"].squeeze(-1) + cfg.gamma * bootstrap * next_q
        state_action = torch.cat([batch["observation"], batch["action"]], -1)
        errors = torch.stack([(critic(state_action).squeeze(-1) - target).abs() for critic in agent.critics])
    assert priorities.shape == (32,)
    torch.testing.assert_close(priorities, errors.max(0).values)


@pytest.mark.gpu
def test_graphed_updates_train_as_the_eager_ones():
    """cudagraphs=true on TD3's two kinds of update, with and without the actor's loss: each
    replays its own CUDA graph, on new batches, and the weights follow the eager updates'."""
    agents, batches = [], []
    for _ in range(2):
        agent, frames, _ = pendulum_agent_and_batch(td3)
        agent.cfg.policy_noise = 0.0  # the graph's random numbers are not eager's
        agents.append(agent.cuda())
        batches.append(frames.select(*agent.batch_keys).cuda())
    (eager, graphed), frames = agents, batches[0]
    eager_optimizers, graphed_optimizers = eager.make_optimizers(), graphed.make_optimizers()
    graphs = GraphedGradients(graphed, graphed_optimizers, nullcontext)
    rows = torch.Generator().manual_seed(1)
    for update in range(1, 25):  # each kind: 5 eager calls, a recording, 6 replays
        batch = frames[torch.randperm(len(frames), generator=rows)[:32]]
        batch["priority_weight"] = torch.rand(32, device="cuda")
        _, _, metrics = graphs(batch.clone(), 1.0, graphed.update_path(update))
        graphed.optimizer_step(graphed_optimizers, update)
        expected, _ = step(eager, eager_optimizers, batch, update)
        assert metrics.keys() == expected.keys()
    assert len(graphs.graphs) == 2
    for mine, theirs in zip(snapshot(graphed), snapshot(eager), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
