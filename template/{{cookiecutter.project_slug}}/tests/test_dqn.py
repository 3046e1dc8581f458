"""The DQN recipe's wiring on a tiny batch, without any distribution; its runs on Atari
and MinAtar on two learners and a replay process."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from {{ cookiecutter.package_name }} import checkpoint, config, evaluate, recipes, train
from {{ cookiecutter.package_name }}.envs import make_env
from {{ cookiecutter.package_name }}.recipes import dqn
from {{ cookiecutter.package_name }}.replay import ReplayShard

from .conftest import ATARI_SHORT, collect_one_batch, family_run, one_learner


def test_loss_returns_priorities_and_the_update_reaches_the_collector_policy():
    torch.manual_seed(0)
    env = make_env("CartPole-v1", num_envs=4, seed=0)
    agent = dqn.Agent(dqn.Config(hidden_sizes=[16], batch_size=16), env)
    frames = collect_one_batch(env, agent.policy, 64).reshape(-1)
    assert frames.batch_size == torch.Size([64])

    shard = ReplayShard(1000, alpha=0.6, beta=0.4)
    shard.extend(frames.select(*agent.batch_keys))
    batch, _, _ = shard.sample(16)
    loss, priorities, metrics = agent(batch)
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert priorities.numel() == 16 and (priorities >= 0).all()

    probe = frames[:4].select("observation")  # one row per env copy, as the policy expects
    before = agent.policy(probe.clone())["action_value"].detach()
    (optimizer,) = agent.make_optimizers().values()
    loss.backward()
    optimizer.step()
    after = agent.policy(probe.clone())["action_value"].detach()
    assert not torch.allclose(before, after), "the collector's policy must share the trained weights"


def test_a_batch_dealt_out_over_three_learners_has_the_whole_batchs_gradient():
    """learners.batch_size_of=run: 8 transitions as 3, 3 and 2, each learner's loss weighted as
    ``config.learner_batch`` says and the gradients averaged as DDP averages them, give the
    gradient of all 8 on one learner (uniform replay: no importance weights)."""
    torch.manual_seed(0)
    env = make_env("CartPole-v1", num_envs=4, seed=0)
    agent = dqn.Agent(dqn.Config(hidden_sizes=[16]), env)
    batch = collect_one_batch(env, agent.policy, 8).reshape(-1).select(*agent.batch_keys)
    overrides = ["recipe=dqn", "algo.batch_size=8", "algo.updates_per_batch=2"]
    cfg = config.load(overrides, train.DEFAULTS)
    shares = [config.learner_batch(cfg, 3, index) for index in range(3)]
    assert [(size, updates) for size, updates, _ in shares] == [(3, 6), (3, 6), (2, 6)]

    parameters = [parameter for parameter in agent.parameters() if parameter.requires_grad]
    whole = torch.autograd.grad(agent(batch)[0], parameters)
    parts = batch.split([size for size, _, _ in shares])
    averaged = [torch.zeros_like(parameter) for parameter in parameters]
    for part, (_, _, weight) in zip(parts, shares, strict=True):
        for total, grad in zip(
            averaged, torch.autograd.grad(agent(part)[0] * weight, parameters), strict=True
        ):
            total += grad / 3
    for expected, got in zip(whole, averaged, strict=True):
        torch.testing.assert_close(got, expected)

    each = config.load([*overrides, "learners.batch_size_of=learner"], train.DEFAULTS)
    assert [config.learner_batch(each, 3, index) for index in range(3)] == [(8, 2, 1.0)] * 3


def test_minatar_replays_uniformly_as_the_paper_and_the_command_line_wins():
    pytest.importorskip("minatar", reason="needs the [minatar] extra")
    assert config.load(["recipe=dqn"], train.DEFAULTS).replay.alpha == 0.6
    minatar = ["recipe=dqn", "env.id=MinAtar/Freeway-v0"]
    assert config.load(minatar, train.DEFAULTS).replay.alpha == 0.0
    assert config.load([*minatar, "replay.alpha=0.5"], train.DEFAULTS).replay.alpha == 0.5


def test_atari_fetches_a_collector_steps_batches_in_one_request_and_the_command_line_wins():
    pytest.importorskip("ale_py", reason="needs the [atari] extra")
    assert config.load(["recipe=dqn"], train.DEFAULTS).replay.batches_per_request == 4
    atari = ["recipe=dqn", "env.id=ALE/Pong-v5"]
    cfg = config.load(atari, train.DEFAULTS)
    assert cfg.replay.batches_per_request == cfg.algo.updates_per_batch == 8
    overridden = config.load([*atari, "replay.batches_per_request=2"], train.DEFAULTS)
    assert overridden.replay.batches_per_request == 2


def test_epsilon_anneals_by_frames_in_closed_form_and_checkpoints_keep_it():
    env = make_env("CartPole-v1", num_envs=2, seed=0)
    config = dqn.Config(eps_init=1.0, eps_end=0.1, eps_frames=10**12)
    agent = dqn.Agent(config, env)
    # A step per frame would take hours here.
    agent.after_collect(None, 5 * 10**11, one_learner)
    assert abs(agent.exploration.eps.item() - 0.55) < 1e-5
    resumed = dqn.Agent(config, env)
    resumed.load_state_dict(agent.state_dict())
    assert resumed.exploration.eps.item() == agent.exploration.eps.item()
    agent.after_collect(None, 10**13, one_learner)  # past eps_frames: it stays at eps_end
    assert abs(agent.exploration.eps.item() - 0.1) < 1e-6


@pytest.mark.slow
def test_dqn_on_atari_on_two_learners_keeps_uint8_frame_stacks(tmp_path):
    summary, batch = family_run(tmp_path, "dqn", "ALE/Pong-v5", ATARI_SHORT)
    # The shard keeps each frame once and samples a transition's two stacks as one tensor:
    # its observation's four frames and the next observation's newest.
    assert "observation" not in batch.keys()
    assert batch["pixels"].dtype == torch.uint8 and batch["pixels"].shape == (4, 5, 84, 84)
    # Both learners share the replay process's machine: their samples' frames came through
    # shared memory, not the socket.
    assert summary["replay_shared_memory_readers"] == [2]
    resolved = OmegaConf.load(tmp_path / "config.yaml")
    # DQN's Atari settings (CleanRL's) came with the env id, with the command line on top.
    assert resolved.env.life_loss and resolved.env.clip_rewards and resolved.algo.lr == 1e-4
    assert resolved.algo.batch_size == 8
    # A Pong point is worth one: game scores lie in [-21, 21].
    assert -21 <= summary["eval_return"] <= 21


@pytest.mark.slow
def test_dqn_on_minatar_on_two_learners_keeps_uint8_channels_first(tmp_path):
    _, batch = family_run(tmp_path, "dqn", "MinAtar/Breakout-v1")
    assert batch["observation"].dtype == torch.uint8 and batch["observation"].shape == (4, 4, 10, 10)
    assert set(batch["observation"].unique().tolist()) <= {0, 1}
    assert OmegaConf.load(tmp_path / "config.yaml").algo.hidden_sizes == [128]  # the MinAtar network


@pytest.mark.slow
def test_atari_evaluation_records_a_video_of_the_game(tmp_path):
    overrides = ["recipe=dqn", "env.id=ALE/Pong-v5", ATARI_SHORT, f"run_dir={tmp_path}"]
    cfg = config.load(overrides, train.DEFAULTS)
    agent = recipes.make_agent(recipes.load("dqn"), cfg.algo, cfg.env)
    checkpoint.save_agent(tmp_path / checkpoint.FINAL, cfg, agent)
    assert evaluate.main([f"checkpoint={tmp_path}", "episodes=1", "video=true"]) == 0
    (video,) = (tmp_path / "videos").glob("*.mp4")
    assert video.stat().st_size > 10_000  # 800 colour frames of the game, not an empty file
    record = json.loads((tmp_path / "evaluation.json").read_text())
    assert record["episodes"] == 1 and -21 <= record["returns"][0] <= 0
