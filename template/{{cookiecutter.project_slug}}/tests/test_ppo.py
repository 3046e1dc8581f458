"""The PPO recipe's wiring on a tiny batch, without any distribution, feed-forward and
recurrent (the LSTM's state carried by the collector, rebuilt through sequences by the
update); and its runs on Atari, MinAtar and MuJoCo on 3 learners (DD-PPO), the
normalisation of MuJoCo's observations the same on every learner, through resume and
evaluate.py."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from torchrl.collectors import Collector
from torchrl.envs import StepCounter
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import set_recurrent_mode

from {{ cookiecutter.package_name }} import checkpoint, evaluate, recipes, train
from {{ cookiecutter.package_name }}.envs import make_env
from {{ cookiecutter.package_name }}.recipes import ppo

from .conftest import (
    ATARI_SHORT,
    collect_one_batch,
    fabric_command,
    learners_run,
    one_learner,
    read_summary,
    run_command,
)


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
    agent.after_collect(batch, frames=160, sum_over_learners=one_learner)
    advantage, target, value = batch["advantage"], batch["value_target"], batch["state_value"]
    assert advantage.shape == target.shape == value.shape == (4, 40, 1)
    torch.testing.assert_close(target, advantage + value)
    # Each state is evaluated once: a next state's value is the following step's value, or
    # where the episode ended or the rollout stops, that of the next state itself.
    with torch.no_grad():
        torch.testing.assert_close(value, agent.value(batch["observation"]))
        torch.testing.assert_close(batch["next", "state_value"], agent.value(batch["next", "observation"]))
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
    agent.after_collect(batch, frames=160, sum_over_learners=one_learner)
    minibatch = batch.reshape(-1)[:64]
    loss, priorities, metrics = agent(minibatch)
    assert priorities is None  # nothing is replayed
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert set(metrics) == {"loss_objective", "loss_critic", "entropy"}

    probe = minibatch[:4]["observation"]
    before = agent.distribution(agent.trunk(probe)).logits.detach()
    critic_before = agent.value(probe).detach()
    optimizers = agent.make_optimizers()
    loss.backward()
    agent.optimizer_step(optimizers, 1)  # the gradients' norm clipped, then Adam steps
    norm = torch.stack([p.grad.norm() for p in agent.parameters() if p.grad is not None]).norm()
    assert norm <= agent.cfg.max_grad_norm + 1e-6
    assert not torch.allclose(before, agent.distribution(agent.trunk(probe)).logits.detach())
    assert not torch.allclose(critic_before, agent.value(probe).detach())


def test_the_objective_is_the_clipped_surrogate():
    agent, batch = make_agent_and_batch()
    agent.after_collect(batch, frames=160, sum_over_learners=one_learner)
    minibatch = batch.reshape(-1)[:64].clone()
    # Shift the behaviour log-probabilities both ways so that many ratios leave the clip range.
    shift = torch.linspace(-1.0, 1.0, 64).unsqueeze(-1)
    minibatch["action_log_prob"] = minibatch["action_log_prob"] + shift.squeeze(-1)
    _, _, metrics = agent(minibatch.clone())

    with torch.no_grad():
        log_prob = agent.distribution(agent.trunk(minibatch["observation"])).log_prob(minibatch["action"])
    ratio = (log_prob - minibatch["action_log_prob"]).exp()
    advantage = minibatch["advantage"].squeeze(-1)
    advantage = (advantage - advantage.mean()) / advantage.std().clamp_min(1e-6)
    epsilon = agent.cfg.clip_epsilon
    assert ((ratio < 1 - epsilon) | (ratio > 1 + epsilon)).sum() >= 16
    clipped = torch.min(ratio * advantage, ratio.clamp(1 - epsilon, 1 + epsilon) * advantage)
    torch.testing.assert_close(metrics["loss_objective"], -clipped.mean(), rtol=1e-4, atol=1e-5)


def test_the_value_loss_is_clipped_around_the_collected_value():
    """With ``clip_value`` (CleanRL's clip_vloss) the value loss is the larger of the squared
    errors of the new value and of the new value kept within the clip range of the old one."""
    agent, batch = make_agent_and_batch()
    agent.cfg.clip_value = True
    agent.after_collect(batch, frames=160, sum_over_learners=one_learner)
    minibatch = batch.reshape(-1)[:64].clone()
    minibatch["state_value"] = minibatch["state_value"] + torch.linspace(-1.0, 1.0, 64).unsqueeze(-1)
    _, _, metrics = agent(minibatch.clone())

    with torch.no_grad():
        value = agent.value(minibatch["observation"])
    old, target, epsilon = minibatch["state_value"], minibatch["value_target"], agent.cfg.clip_epsilon
    clipped = old + (value - old).clamp(-epsilon, epsilon)
    assert (clipped != value).sum() >= 16
    expected = torch.max((value - target).square(), (clipped - target).square()).mean()
    torch.testing.assert_close(metrics["loss_critic"], agent.cfg.critic_coeff * expected)


def test_the_learning_rate_falls_with_the_frames_collected_and_a_restored_agent_goes_on_from_there():
    env = make_env("CartPole-v1", num_envs=4, seed=0)
    config = ppo.Config(hidden_sizes=[16], lr=1e-3, lr_decay_frames=1000)
    agent = ppo.Agent(config, env)
    (adam,) = agent.make_optimizers().values()
    batch = collect_one_batch(env, agent.policy, 160)
    rates = []
    for _ in range(2):
        agent.after_collect(batch, frames=250, sum_over_learners=one_learner)  # e.g. 2 learners' frames
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
        again.after_collect(batch, frames=250, sum_over_learners=one_learner)
        rates.append(optimizers["adam"].param_groups[0]["lr"])
        optimizers["adam"].step()
    assert rates == pytest.approx([0.5e-3, 0.25e-3, 0.0])


def test_a_cut_rollout_bootstraps_from_the_value_of_its_next_state():
    """The straggler threshold cuts rollouts short: a cut is a truncation, never a
    termination, so the last step of a copy still in its episode bootstraps from the
    value of its next state."""
    agent, batch = make_agent_and_batch()
    cut = batch[:, :7].clone()  # 7 of 40 steps, as a rollout cut short
    agent.after_collect(cut, frames=28, sum_over_learners=one_learner)
    going_on = ~cut["next", "done"][:, -1].squeeze(-1)
    assert going_on.any()
    with torch.no_grad():
        next_value = agent.value(cut["next", "observation"][:, -1])
    last = cut[:, -1]
    expected = last["next", "reward"] + agent.cfg.gamma * next_value - last["state_value"]
    torch.testing.assert_close(last["advantage"][going_on], expected[going_on])


def test_running_moments_combine_every_learners_batch():
    """Each learner's update sums count, sum and squares over the learners first: the
    moments are those of all learners' observations, on every learner."""
    torch.manual_seed(0)
    mine, theirs = torch.randn(300, 3) * 2 + 1, torch.randn(100, 3) * 5 - 2
    moments = ppo.RunningMoments((3,))

    def sum_with_another_learner(values: torch.Tensor) -> torch.Tensor:
        other = torch.cat([torch.tensor([100.0]), theirs.sum(0), theirs.square().sum(0)]).double()
        return values + other

    moments.update(mine, sum_with_another_learner)
    both = torch.cat([mine, theirs]).double()
    assert moments.count.item() == pytest.approx(400 + 1e-4)
    torch.testing.assert_close(moments.mean, both.mean(0) * 400 / (400 + 1e-4))
    torch.testing.assert_close(moments.var, both.var(0, unbiased=False), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_the_policy_samples_while_collecting_and_plays_greedily_in_evaluation(env_id):
    """What the collector stores is a sample of the loss's distribution with its
    log-probability; in deterministic mode (greedy evaluation) the action is the
    Gaussian's mean, or the likeliest of the discrete actions."""
    env = make_env(env_id, num_envs=64, seed=0)
    agent = ppo.Agent(ppo.Config(hidden_sizes=[16], normalize_observations=True), env)
    state = env.reset()
    with torch.no_grad():
        with set_exploration_type(ExplorationType.RANDOM):
            sampled = agent.policy(state.clone())
        with set_exploration_type(ExplorationType.DETERMINISTIC):
            greedy = agent.policy(state.clone())
        distribution = agent.distribution(agent.trunk(sampled["observation_normalized"]))
    torch.testing.assert_close(sampled["observation_normalized"], agent.normalizer(state["observation"]))
    torch.testing.assert_close(sampled["action_log_prob"], distribution.log_prob(sampled["action"]))
    assert sampled["action"].shape == state.shape + env.action_spec_unbatched.shape
    torch.testing.assert_close(greedy["action"], distribution.deterministic_sample)
    assert not torch.equal(sampled["action"], greedy["action"])


def test_continuous_actions_reach_the_env_within_its_bounds():
    """A Gaussian policy samples beyond the bounds; the env gets the action clipped, and its
    action spec keeps the bounds the other recipes squash into."""
    env = make_env("Pendulum-v1", num_envs=1, seed=0)
    assert env.action_spec.space.high.max() == 2.0  # not widened to infinity
    outcomes = []
    for torque in (2.0, 50.0):
        env.set_seed(0)
        state = env.reset()
        state["action"] = torch.full((1, 1), torque)
        outcomes.append(env.step(state)["next", "observation"])
    torch.testing.assert_close(outcomes[0], outcomes[1])


def recurrent_agent_and_batches():
    """A small recurrent agent on 4 copies of CartPole, each step numbered within its
    episode (torchrl's ``StepCounter``), and two consecutive batches of 30 steps from a
    collector set as the learner's is."""
    torch.manual_seed(0)
    config = ppo.Config(hidden_sizes=[16], recurrent=True, lstm_hidden_size=8)
    agent = ppo.Agent(config, make_env("CartPole-v1", num_envs=4, seed=0))
    env = make_env("CartPole-v1", num_envs=4, seed=0, policy=agent.policy).append_transform(StepCounter())
    collector = Collector(
        env, agent.policy, frames_per_batch=4 * 30, total_frames=-1, track_traj_ids=False,
        auto_register_policy_transforms=False, use_buffers=False, return_same_td=True,
    )  # fmt: skip
    batches = iter(collector)
    first, second = next(batches).clone(), next(batches).clone()
    collector.shutdown()
    return agent, first, second


def test_a_recurrent_policy_carries_its_state_across_batches_and_starts_each_episode_from_zeros():
    agent, first, second = recurrent_agent_and_batches()
    stream = torch.cat([first, second], dim=1)  # each copy's 60 steps in time order
    starts = stream[ppo.IS_INIT].squeeze(-1)
    # An episode starts exactly where the env counts step 0, and from a zero state.
    assert torch.equal(starts, stream["step_count"].squeeze(-1) == 0) and starts[:, 1:].sum() >= 4
    state = stream[ppo.STATE[0]]
    assert (state[starts] == 0).all() and (state[~starts] != 0).any(-1).all()
    # The second batch goes on from the first: some copy's episode runs across the boundary.
    assert (second["step_count"][:, 0] > 0).any()
    # Each step's state is the LSTM's, run from zeros through its episode's steps so far,
    # across the two batches: the state after a step is that of the LSTM's output.
    sequences = stream.select(*ppo.STATE, ppo.IS_INIT).clone()
    sequences[ppo.IS_INIT][:, 0] = True
    for key in ppo.STATE:
        sequences[key].zero_()
    with torch.no_grad(), set_recurrent_mode(True):
        sequences[ppo.FEATURES] = agent.trunk(stream["observation"])
        memory = agent.memory(sequences)[ppo.MEMORY]
    torch.testing.assert_close(memory, stream["next", ppo.STATE[0]].squeeze(-2), rtol=1e-5, atol=1e-6)


def test_a_recurrent_update_runs_the_lstm_through_whole_sequences_from_their_first_state():
    """Before any update the weights are those that acted: the sequences rebuilt from the
    state kept with each one's first step give back the collected log-probabilities, for
    any copies (a minibatch), a rollout that starts mid-episode (the second batch) and one
    cut short (the straggler threshold's)."""
    agent, _, second = recurrent_agent_and_batches()
    assert (second["step_count"][:, 0] > 0).any() and second[ppo.IS_INIT][:, 1:].any()
    for rollout in (second, second[:, :7]):
        rollout = rollout.clone()
        agent.after_collect(rollout, frames=rollout.numel(), sum_over_learners=one_learner)
        with torch.no_grad():
            # The values GAE used are the critic's on the states the policy acted from.
            value = agent.critic_head(agent.step_features(rollout))
            torch.testing.assert_close(rollout["state_value"], value)
            for copies in (torch.arange(4), torch.tensor([3, 1])):
                sequences = rollout[copies]
                distribution = agent.distribution(agent.sequence_features(sequences))
                log_prob = distribution.log_prob(sequences["action"])
                torch.testing.assert_close(log_prob, sequences["action_log_prob"], rtol=1e-5, atol=1e-5)
    agent.after_collect(second, frames=second.numel(), sum_over_learners=one_learner)
    loss, _, metrics = agent(second[torch.tensor([0, 2])])
    assert torch.isfinite(loss) and metrics["loss_objective"].abs() < 1e-5  # ratio 1: no objective yet
    optimizers = agent.make_optimizers()
    before = [parameter.detach().clone() for parameter in agent.memory.parameters()]
    loss.backward()
    agent.optimizer_step(optimizers, 1)
    assert all(not torch.equal(old, new) for old, new in zip(before, agent.memory.parameters(), strict=True))


# A few hundred frames per family on 3 learners (DD-PPO: no replay process), one minibatch
# an epoch; pixel games cut at 800 emulator frames.
FAMILY_RUN = ["env.num_envs=4", "collector.frames_per_batch=64", "total_frames=384", "algo.epochs=1",
              "algo.minibatch_size=64", "eval.episodes=3", "eval.every=0", "log_every=192"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("env_id", "extra", "observation", "clip"),
    [
        # CleanRL's ppo_atari.py clips at 0.1, gymnax-blines' MinAtar PPO at 0.2.
        ("ALE/Breakout-v5", [ATARI_SHORT, "algo.hidden_sizes=[32]"], "uint8 (4, 84, 84)", 0.1),
        ("MinAtar/Breakout-v1", [], "uint8 (4, 10, 10)", 0.2),
    ],
)
def test_ppo_on_pixels_trains_three_identical_learners_on_uint8_frames(
    tmp_path, env_id, extra, observation, clip
):
    pytest.importorskip("ale_py" if env_id.startswith("ALE") else "minatar", reason="needs its extra")
    result = learners_run(3, "recipe=ppo", f"env.id={env_id}", *FAMILY_RUN, *extra, f"run_dir={tmp_path}")
    summary = read_summary(result)
    assert summary["roles"] == {"0": "learner", "1": "learner", "2": "learner"}
    # The straggler threshold is in force: rollouts may be cut, frames count as collected,
    # and every learner runs one minibatch (an update) per step however long its rollout.
    rollouts = list(summary["learner_rollouts"].values())
    assert summary["frames_collected"] == sum(learner["frames"] for learner in rollouts) >= 384
    assert all(summary["updates"] == learner["rollouts"] for learner in rollouts)
    assert len(set(summary["learner_param_checksums"].values())) == 1
    cfg = OmegaConf.load(tmp_path / "config.yaml")
    assert cfg.algo.clip_epsilon == clip and cfg.algo.critic_loss == "l2"  # the family's settings
    env = make_env(cfg.env, 2, seed=0)
    spec = env.observation_spec["observation"]
    assert f"{str(spec.dtype).removeprefix('torch.')} {tuple(spec.shape[1:])}" == observation
    agent = recipes.make_agent(ppo, cfg.algo, cfg.env, 2)
    batch = collect_one_batch(env, agent.policy, 16)
    assert batch["observation"].dtype == torch.uint8  # bytes until the network's first layer
    agent.after_collect(batch, frames=16, sum_over_learners=one_learner)
    loss, _, _ = agent(batch.reshape(-1))
    assert torch.isfinite(loss)


@pytest.mark.slow
def test_ppo_on_mujoco_keeps_one_normalisation_on_every_learner_through_resume_and_evaluation(tmp_path):
    pytest.importorskip("mujoco", reason="needs the [mujoco] extra")
    run_dir = tmp_path / "run"
    overrides = ["recipe=ppo", "env.id=Hopper-v5", *FAMILY_RUN, "checkpoint.every=192", f"run_dir={run_dir}"]
    overrides = [item for item in overrides if not item.startswith("env.num_envs")]  # MuJoCo's: 1 per learner
    command = fabric_command(3, "train.py", *overrides, "collector.frames_per_batch=16")
    summary = read_summary(run_command(command))
    frames = summary["frames_collected"]  # 384 or more: the straggler threshold may cut rollouts
    assert frames >= 384 and checkpoint.Meta.read(checkpoint.latest(run_dir)).frames == frames
    # The learners' weights and normalisation statistics are one; the statistics count
    # every frame every learner collected, each once.
    assert len(set(summary["learner_param_checksums"].values())) == 1
    final = torch.load(run_dir / checkpoint.FINAL, weights_only=True)["agent"]
    assert final["normalizer.count"].item() == pytest.approx(frames + 1e-4)
    assert final["rewards.moments.count"].item() == pytest.approx(frames + 1e-4)

    # Resumed on 2 learners from the last checkpoint, to 768 frames: the statistics go on.
    more = [*overrides, "collector.frames_per_batch=16", "total_frames=768", f"resume={run_dir}"]
    resumed = read_summary(learners_run(2, *more))
    assert resumed["frames_collected"] >= 768
    assert len(set(resumed["learner_param_checksums"].values())) == 1
    final = torch.load(run_dir / checkpoint.FINAL, weights_only=True)["agent"]
    assert final["normalizer.count"].item() == pytest.approx(resumed["frames_collected"] + 1e-4)

    # evaluate.py rebuilds the agent with them: the policy it plays normalises as training's.
    state, recipe = checkpoint.load(run_dir / checkpoint.FINAL)
    agent = recipes.make_agent(recipe, state["algo"], state["env"])
    agent.load_state_dict(state["agent"])
    torch.testing.assert_close(agent.normalizer.mean, final["normalizer.mean"])
    assert evaluate.main([f"checkpoint={run_dir}", "episodes=2"]) == 0
    record = json.loads((run_dir / "evaluation.json").read_text())
    assert record["episodes"] == 2 and all(value > 0 for value in record["returns"])


def test_cuda_graphs_refuse_a_recurrent_policy_in_one_line(tmp_path, capsys):
    """A CUDA graph cannot record the LSTM through sequences split at episode starts: the
    run stops before any rank starts, wherever it would have run."""
    overrides = ["recipe=ppo", "algo.recurrent=true", "cudagraphs=true", f"run_dir={tmp_path}"]
    assert train.main(overrides) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not any(tmp_path.iterdir())
    assert captured.err.strip() == (
        "error: recipe ppo: cudagraphs=true cannot record its recurrent update "
        "(torchrl's LSTM splits sequences at episode starts, by the batch); run it without"
    )
