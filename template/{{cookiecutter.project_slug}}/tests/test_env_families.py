"""Env families: their preprocessing, raw scores beside what training sees, discrete
observations as one-hot vectors, and the one-line errors of a missing extra and of an
observation space no network takes. The recipes' runs on each family are in their tests
(test_<recipe>.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from {{ cookiecutter.package_name }} import evaluate, recipes, train
from {{ cookiecutter.package_name }}.envs import POPGYM, TrainingBatches, family_of, make_env

from .conftest import PROJECT, RECIPES, command_env, read_summary, run_command, tiny_overrides


@pytest.mark.slow
def test_atari_training_sees_clipped_rewards_and_life_losses_but_returns_are_game_scores():
    """Space Invaders pays 5 to 30 points an alien and has three lives."""
    settings = {"id": "ALE/SpaceInvaders-v5", "clip_rewards": True, "life_loss": True}
    env = make_env(settings, 2, seed=0)
    torch.manual_seed(0)
    rollout = TrainingBatches(clip_rewards=True, life_loss=True)(env.rollout(600, break_when_any_done=False))
    env.close()
    reward, score = rollout["next", "reward"].squeeze(-1), rollout["next", "episode_reward"].squeeze(-1)
    done, terminated = rollout["next", "done"].squeeze(-1), rollout["next", "terminated"].squeeze(-1)
    assert reward.max() == 1  # clipped for training
    assert (score.diff(dim=-1) > 1).any()  # the score grows by the game's points
    # A lost life is terminal for the value targets; the game goes on (its score too).
    life_lost = terminated & ~done
    assert life_lost.any()
    following = score[:, 1:][life_lost[:, :-1]]
    assert (following >= score[:, :-1][life_lost[:, :-1]]).all() and (following > 0).any()


def test_atari_games_wait_for_torchrl_to_reset_them():
    """Training steps ale-py's vector env through ``MaskedResets``. Were a game reset by
    torchrl reset again at its next step (ale-py's own autoreset), that step's stack would
    not go on from the one before."""
    pytest.importorskip("ale_py", reason="needs the [atari] extra")
    settings = {"id": "ALE/Pong-v5", "kwargs": {"max_num_frames_per_episode": 100}}
    env = make_env(settings, 2, seed=0)
    rollout = env.rollout(120, break_when_any_done=False)  # about 25 steps per episode
    env.close()
    observation, following = rollout["observation"], rollout["next", "observation"]
    done = rollout["next", "done"].squeeze(-1)
    assert done.sum(-1).min() >= 3
    # Every step, the first after a reset too, shifts the stack by one new frame.
    assert torch.equal(following[:, :, :-1], observation[:, :, 1:])
    # After an end the next step starts from ale-py's reset stack (no frames before the
    # first): a new episode, not the old one going on.
    started = observation[:, 1:][done[:, :-1]]
    assert (started[:, :-1] == 0).all() and (started[:, -1] != 0).any(dim=(-1, -2)).all()
    assert torch.equal(observation[:, 1:][~done[:, :-1]], following[:, :-1][~done[:, :-1]])


def test_atari_single_frames_for_a_recurrent_policy_from_every_backend():
    """env.frame_stack=1: ale-py's vector env (training) and gymnasium's wrappers
    (evaluation, sync) give the same single 84x84 frame, and evaluation plays from it."""
    pytest.importorskip("ale_py", reason="needs the [atari] extra")
    settings = {"id": "ALE/Pong-v5", "frame_stack": 1, "kwargs": {"max_num_frames_per_episode": 100}}
    for vectorization, training in (("auto", True), ("sync", False)):
        env = make_env({**settings, "vectorization": vectorization}, 2, seed=0, training=training)
        observation = env.rollout(3, break_when_any_done=False)["observation"]
        env.close()
        assert observation.shape == (2, 3, 1, 84, 84) and observation.dtype == torch.uint8, vectorization


# A fresh process (the test's own has other threads coming and going), torch on one
# thread: the threads that 8 games add with env.threads=1, and with env.kwargs.num_threads=2
# (ale-py's own name) over env.threads=1.
COUNT_THREADS = """
import os, torch
from {{ cookiecutter.package_name }}.envs import make_env
torch.set_num_threads(1)
before = len(os.listdir("/proc/self/task"))
pong = {"id": "ALE/Pong-v5", "threads": 1}
envs = [make_env(game, 8, seed=0) for game in (pong, {**pong, "kwargs": {"num_threads": 2}})]
print(len(os.listdir("/proc/self/task")) - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_atari_games_step_on_as_many_threads_as_env_threads_says():
    """ale-py's vector env would start a thread per core of the machine, for every learner:
    env.threads (the rank's share, by train.py's default) sets them instead."""
    pytest.importorskip("ale_py", reason="needs the [atari] extra")
    result = run_command([sys.executable, "-c", COUNT_THREADS], timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert int(result.stdout.split()[-1]) == 1 + 2, result.stdout


# Run at start-up by the subprocess (Python imports the first sitecustomize on its path):
# the import system no longer finds the package, as on a machine without it.
HIDE_PACKAGE = """
import sys
from importlib.machinery import PathFinder


class WithoutPackage(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] == {module!r}:
            return None
        return super().find_spec(name, path, target)


sys.meta_path[sys.meta_path.index(PathFinder)] = WithoutPackage
"""


# The two ways envs.family_of finds a family whose package is missing: by the id's prefix
# (Atari's, MinAtar's and POPGym's ids are registered by their packages) and by the
# registered entry point (MuJoCo's, which gymnasium registers). A process each costs about
# 8 s of start-up on 2 cores; the families of a way differ only in envs.py's tables.
@pytest.mark.parametrize(
    ("module", "env_id", "extra"),
    [("ale_py", "ALE/Pong-v5", "atari"), ("mujoco", "Hopper-v5", "mujoco")],
)
def test_a_missing_extra_is_one_error_line_naming_the_pip_command(tmp_path, module, env_id, extra):
    (tmp_path / "sitecustomize.py").write_text(HIDE_PACKAGE.format(module=module))
    env = command_env()
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    command = [sys.executable, "train.py", f"env.id={env_id}"]
    result = subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == [f"error: env.id={env_id} needs {module}: pip install -e '.[{extra}]'"], result.stderr


def test_discrete_observations_reach_the_networks_as_one_hot_vectors():
    """FrozenLake's observation is the agent's cell, one of 16: the networks see a float32
    vector with a 1 at that cell, in training and in evaluation's env alike."""
    for training in (True, False):
        env = make_env("FrozenLake-v1", 3, seed=0, training=training)
        spec = env.observation_spec["observation"]
        assert spec.dtype == torch.float32 and spec.shape == (3, 16)
        rollout = env.rollout(30, break_when_any_done=False)
        env.close()
        observation = rollout["observation"]
        assert observation.dtype == torch.float32
        assert torch.equal(observation.sum(-1), torch.ones(rollout.shape))
        assert set(observation.unique().tolist()) == {0.0, 1.0}
        assert observation[:, 0].argmax(-1).tolist() == [0, 0, 0]  # every episode starts in cell 0


# FrozenLake's actions are discrete too: the recipes that take them.
DISCRETE_ACTION_RECIPES = [name for name in RECIPES if "discrete" in recipes.load(name).Agent.action_spaces]


@pytest.mark.parametrize("recipe", DISCRETE_ACTION_RECIPES)
def test_a_recipe_trains_and_evaluates_on_discrete_observations(tmp_path, recipe):
    overrides = [*tiny_overrides(recipe), "env.id=FrozenLake-v1", "total_frames=1024", "eval.every=0"]
    summary = read_summary(run_command([sys.executable, "train.py", *overrides, f"run_dir={tmp_path}"]))
    assert summary["frames_collected"] == 1024 and summary["updates"] > 0
    assert summary["eval_episodes"] >= 10 and 0 <= summary["eval_return"] <= 1


def test_an_observation_space_no_network_takes_is_one_error_line(capsys):
    """Blackjack's observation is a tuple of three discrete values: refused as the
    configuration loads (--print-config, so that a check that let it through fails the test
    at once instead of training)."""
    assert train.main(["env.id=Blackjack-v1", "--print-config"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip().splitlines() == [
        "error: env.id=Blackjack-v1 has Tuple observations: the recipes take Box, Discrete, "
        "MultiDiscrete or MultiBinary ones"
    ], captured.err


def test_popgym_ids_are_their_own_family_and_their_multi_discrete_observations_one_hot():
    """POPGym registers its ids when imported; CountRecall shows two cards of two kinds
    (``MultiDiscrete([2, 2])``): two one-hot pairs side by side."""
    pytest.importorskip("popgym", reason="needs the [popgym] extra")
    assert family_of("popgym-CountRecallEasy-v0") == POPGYM
    env = make_env("popgym-CountRecallEasy-v0", 2, seed=0)
    observation = env.rollout(20, break_when_any_done=False)["observation"]
    env.close()
    assert observation.dtype == torch.float32 and observation.shape == (2, 20, 4)
    assert torch.equal(observation.unflatten(-1, (2, 2)).sum(-1), torch.ones(2, 20, 2))


@pytest.mark.skipif("ppo" not in RECIPES, reason="this project has no ppo recipe")
def test_recurrent_ppo_trains_on_a_popgym_env_in_one_process_and_its_agent_plays(tmp_path):
    """RepeatPrevious shows a card (``Discrete(4)``, one-hot) and pays for naming the one
    shown a few steps before: an env for memory. POPGym keeps an episode's return within
    [-1, 1]."""
    pytest.importorskip("popgym", reason="needs the [popgym] extra")
    overrides = [*tiny_overrides("ppo"), "env.id=popgym-RepeatPreviousEasy-v0", "algo.recurrent=true"]
    overrides += ["total_frames=1024", "eval.every=0", f"run_dir={tmp_path}"]
    summary = read_summary(run_command([sys.executable, "train.py", *overrides]))
    # 4 steps x 2 epochs x 2 minibatches of 4 of the 8 copies' sequences (128 frames each).
    assert summary["frames_collected"] == 1024 and summary["updates"] == 4 * 2 * 2
    assert summary["eval_episodes"] >= 10 and -1 <= summary["eval_return"] <= 1
    assert evaluate.main([f"checkpoint={tmp_path}", "episodes=2"]) == 0
