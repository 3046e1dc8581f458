"""Env families: their preprocessing, raw scores beside what training sees, and the
one-line error of a missing extra. The recipes' runs on each family are in their tests
(test_<recipe>.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from {{ cookiecutter.package_name }}.envs import TrainingBatches, make_env

from .conftest import PROJECT, command_env


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


@pytest.mark.parametrize(
    ("module", "env_id", "extra"),
    [
        ("ale_py", "ALE/Pong-v5", "atari"),
        ("minatar", "MinAtar/Breakout-v1", "minatar"),
        ("mujoco", "Hopper-v5", "mujoco"),
    ],
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
