"""The collectors: batches in the layout recipes read, and an async collector's weights."""

from __future__ import annotations

import traceback

import pytest
import torch
from omegaconf import OmegaConf
from tensordict.nn import TensorDictModule
from torch import nn

from {{ cookiecutter.package_name }}.collector import (
    POLICY_VERSION,
    CollectingFailed,
    CollectorFailed,
    make_collector,
    next_batch,
)


def collector_config(mode: str, num_envs: int = 4, frames_per_batch: int = 200, workers: int = 1):
    return OmegaConf.create(
        {
            "env": {"id": "CartPole-v1", "num_envs": num_envs},
            "collector": {"frames_per_batch": frames_per_batch, "mode": mode, "workers": workers},
        }
    )


class PushRight(nn.Module):
    """Action 1 (push right) when its one weight is positive, else action 0."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        right = (self.weight > 0).long().expand(observation.shape[:-1])
        return nn.functional.one_hot(right, 2)


def test_sync_batches_are_time_last_and_chain_observations_across_episode_ends():
    policy = TensorDictModule(PushRight(), in_keys=["observation"], out_keys=["action"])
    collector = make_collector(
        collector_config("sync"), policy, seed=7, total_frames=400, device=torch.device("cpu")
    )
    batches = list(collector)
    collector.shutdown()
    assert [batch.batch_size for batch in batches] == [torch.Size([4, 50])] * 2
    batch = torch.cat(batches, dim=1)
    done = batch["next", "done"].squeeze(-1)
    # Always pushing right ends a CartPole episode within a few dozen steps.
    assert done.sum() >= 8
    # Within an episode a step's next observation is the following step's observation;
    # at an episode end it is the episode's last one, and the next step starts afresh.
    follows = (batch["next", "observation"][:, :-1] == batch["observation"][:, 1:]).all(-1)
    assert follows[~done[:, :-1]].all()
    assert not follows[done[:, :-1]].any()
    # episode_reward is the return so far, carried from one batch to the next: CartPole
    # pays 1 per step.
    steps_in_episode = batch["next", "episode_reward"].squeeze(-1)
    assert (steps_in_episode[:, 1:][done[:, :-1]] == 1).all()
    assert (steps_in_episode.diff(dim=-1)[~done[:, :-1]] == 1).all()


def test_random_frames_act_at_random_then_the_policy_acts():
    policy = TensorDictModule(PushRight(), in_keys=["observation"], out_keys=["action"])
    config, cpu = collector_config("sync"), torch.device("cpu")
    collector = make_collector(config, policy, seed=7, total_frames=800, device=cpu, random_frames=300)
    actions = [batch["action"].argmax(-1) for batch in collector]
    collector.shutdown()
    # 300 random frames round up to two whole batches of 200; the policy always pushes left.
    assert [(action == 1).float().mean().item() > 0.3 for action in actions] == [True, True, False, False]
    assert (actions[2] == 0).all() and (actions[3] == 0).all()


def test_a_collector_on_the_cpu_names_no_device():
    """A named device makes torchrl cast every step's tensordict (docs/distributed.md, "The data path")."""
    policy = TensorDictModule(PushRight(), in_keys=["observation"], out_keys=["action"])
    collector = make_collector(
        collector_config("sync"), policy, seed=7, total_frames=200, device=torch.device("cpu")
    )
    batch = next(iter(collector))
    env_device = collector.env.device
    collector.shutdown()
    assert env_device is None and batch.device is None
    assert batch["next", "observation"].device.type == "cpu"


def test_async_collector_acts_with_the_weights_pushed_to_it():
    module = PushRight()
    policy = TensorDictModule(module, in_keys=["observation"], out_keys=["action"])
    collector = make_collector(
        collector_config("async", frames_per_batch=64),
        policy,
        seed=0,
        total_frames=64 * 40,
        device=torch.device("cpu"),
    )
    batches = iter(collector)
    try:
        first = next(batches)
        assert (first[POLICY_VERSION] == 0).all() and (first["action"].argmax(-1) == 0).all()
        with torch.no_grad():
            module.weight.fill_(1.0)  # the learner's weights change; its collector's copy does not
        for _ in range(3):
            batch = next(batches)
        assert (batch[POLICY_VERSION] == 0).all() and (batch["action"].argmax(-1) == 0).all()
        collector.update_policy_weights_(policy)
        # The batch in flight may straddle the push. The push returns once the child has
        # the weights, and the child starts the next batch only when this one is taken,
        # so every step of that batch acts with them. A frame's version is the one in
        # force when its observation arrived: that batch's first observation may have
        # arrived before the push, at the end of the batch in flight.
        next(batches)
        batch = next(batches)
        assert (batch["action"].argmax(-1) == 1).all() and (batch[POLICY_VERSION][:, 1:] == 1).all()
        batch = next(batches)
        assert (batch[POLICY_VERSION] == 1).all() and (batch["action"].argmax(-1) == 1).all()
    finally:
        collector.shutdown()


def test_collector_workers_step_the_one_process_copies_with_the_weights_pushed_to_them():
    """collector.workers=2: each worker steps half the copies, seeded as one process seeds
    them, so a batch is the one process's batch; the workers act with a copy of the policy
    that takes the weights pushed to it, and stop at the frames asked for."""
    cpu = torch.device("cpu")
    single = make_collector(
        collector_config("sync"),
        TensorDictModule(PushRight(), in_keys=["observation"], out_keys=["action"]),
        seed=7,
        total_frames=200,
        device=cpu,
    )
    expected = next(iter(single))
    single.shutdown()
    module = PushRight()
    learners_policy = TensorDictModule(module, in_keys=["observation"], out_keys=["action"])
    workers_policy = TensorDictModule(PushRight(), in_keys=["observation"], out_keys=["action"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a learner's share of the cores, less than torch's default here
    collector = make_collector(
        collector_config("sync", workers=2), workers_policy, seed=7, total_frames=800, device=cpu
    )
    try:
        batches = iter(collector)
        first = next(batches)
        assert first.batch_size == torch.Size([4, 50])
        for key in ("observation", ("next", "observation"), "action", ("next", "episode_reward")):
            assert torch.equal(first[key], expected[key]), key
        with torch.no_grad():
            module.weight.fill_(1.0)
        collector.update_policy_weights_(learners_policy)
        assert all((batch["action"].argmax(-1) == 1).all() for batch in batches)
        assert collector.ended() is None
    finally:
        collector.shutdown()
        left_with = torch.get_num_threads()
        torch.set_num_threads(threads)
    assert left_with == 1  # the learner's threads, whatever torchrl's shutdown sets


def test_async_collector_workers_hand_out_whole_batches_and_act_randomly_for_the_frames_asked():
    """collector.workers=2 in async mode: each worker hands out whole batches of its half of
    the copies, and the first random_frames (rounded up to whole batches) act at random,
    though every worker starts a batch before any comes back."""
    policy = TensorDictModule(PushRight(), in_keys=["observation"], out_keys=["action"])
    collector = make_collector(
        collector_config("async", workers=2),
        policy,
        seed=7,
        total_frames=1200,
        device=torch.device("cpu"),
        random_frames=500,
    )
    try:
        batches = list(collector)
        assert [batch.batch_size for batch in batches] == [torch.Size([2, 100])] * 6
        # The policy always pushes left (action 0); a random batch of 200 frames pushes right too.
        random_batches = [bool((batch["action"].argmax(-1) == 1).any()) for batch in batches]
        assert sum(random_batches) == 3, random_batches
        assert collector.ended() is None
    finally:
        collector.shutdown()


class WrongShape(nn.Module):
    """A recipe's shape bug: a layer sized for 3 features on CartPole's 4."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 2)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.layer(observation)


def test_an_error_in_the_policy_keeps_its_own_message_and_line(caplog):
    """Only a dead collector process is reported as one: a policy that fails in the
    learner's own process (sync mode) is named with its own error in one line, its
    traceback in this rank's log and the error itself as the line's cause."""
    policy = TensorDictModule(WrongShape(), in_keys=["observation"], out_keys=["action"])
    collector = make_collector(
        collector_config("sync"), policy, seed=0, total_frames=400, device=torch.device("cpu")
    )
    with caplog.at_level("ERROR"), pytest.raises(CollectingFailed) as raised:
        next_batch(collector, iter(collector), "rank 0 (learner)", "CartPole-v1")
    collector.shutdown()
    assert str(raised.value).startswith("collecting from CartPole-v1: RuntimeError: mat1 and mat2")
    assert not isinstance(raised.value, CollectorFailed) and "\n" not in str(raised.value)
    cause = raised.value.__cause__
    assert isinstance(cause, RuntimeError)
    failing_line = "return self.layer(observation)"
    assert failing_line in [frame.line for frame in traceback.extract_tb(cause.__traceback__)]
    assert failing_line in caplog.text  # the whole traceback, in this rank's log
