"""Env families: Atari, MinAtar and MuJoCo through the whole runtime, their preprocessing,
raw scores, and the one-line error of a missing extra."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from {{ cookiecutter.package_name }} import checkpoint, config, recipes
from {{ cookiecutter.package_name }}.envs import life_loss_terminal, make_env
from {{ cookiecutter.package_name }}.replay import ReplayShard

from .conftest import PROJECT, RECIPES, command_env, fabric_run, load_script, read_summary

needs_dqn = pytest.mark.skipif("dqn" not in RECIPES, reason="this project has no DQN recipe")
needs_sac = pytest.mark.skipif("sac" not in RECIPES, reason="this project has no SAC recipe")
train = load_script("train")
evaluate = load_script("evaluate")

# A few hundred frames on 3 ranks (one replay rank, two learners), a checkpoint at the end
# to look into the replay shard. Atari games are cut at 800 emulator frames (200 steps).
SMALL = [
    "env.num_envs=4",
    "collector.frames_per_batch=32",
    "total_frames=384",
    "replay.capacity=1000",
    "algo.learning_starts=128",
    "algo.updates_per_batch=2",
    "algo.batch_size=8",
    "eval.episodes=2",
    "eval.every=0",
    "log_every=128",
    "checkpoint.every=384",
]
ATARI_SHORT = "env.kwargs.max_num_frames_per_episode=800"


def replay_sample(run_dir: Path, priority_key: str) -> dict:
    """Four transitions from the run's replay shard, as its checkpoint restores it."""
    (folder,) = (run_dir / "checkpoints").glob("frames-*")
    cfg = OmegaConf.load(run_dir / "config.yaml")
    shard = ReplayShard(cfg.replay.capacity, cfg.replay.alpha, cfg.replay.beta, priority_key)
    shard.load(str(folder / "replay-0"))
    batch, *_ = shard.sample(4)
    return batch


def three_rank_run(tmp_path: Path, recipe: str, env_id: str, *extra: str) -> tuple[dict, dict]:
    result = fabric_run(3, f"recipe={recipe}", f"env.id={env_id}", *SMALL, *extra, f"run_dir={tmp_path}")
    summary = read_summary(result)
    assert summary["roles"] == {"0": "replay", "1": "learner", "2": "learner"}
    assert summary["frames_collected"] == summary["replay_size"] == 384
    assert summary["updates"] > 0 and summary["eval_episodes"] == 2
    checksums = set(summary["learner_param_checksums"].values())
    assert len(checksums) == 1  # the learners stayed identical
    return summary, replay_sample(tmp_path, recipes.load(recipe).Agent.priority_key)


@pytest.mark.slow
@needs_dqn
def test_dqn_on_atari_through_three_ranks_keeps_uint8_frame_stacks(tmp_path):
    summary, batch = three_rank_run(tmp_path, "dqn", "ALE/Pong-v5", ATARI_SHORT)
    for key in ("observation", ("next", "observation")):
        assert batch[key].dtype == torch.uint8 and batch[key].shape == (4, 4, 84, 84)
    resolved = OmegaConf.load(tmp_path / "config.yaml")
    # DQN's Atari settings (CleanRL's) came with the env id, with the command line on top.
    assert resolved.env.life_loss and resolved.env.clip_rewards and resolved.algo.lr == 1e-4
    assert resolved.algo.batch_size == 8
    # A Pong point is worth one: game scores lie in [-21, 21].
    assert -21 <= summary["eval_return"] <= 21


@pytest.mark.slow
@needs_dqn
def test_dqn_on_minatar_through_three_ranks_keeps_uint8_channels_first(tmp_path):
    _, batch = three_rank_run(tmp_path, "dqn", "MinAtar/Breakout-v1")
    assert batch["observation"].dtype == torch.uint8 and batch["observation"].shape == (4, 4, 10, 10)
    assert set(batch["observation"].unique().tolist()) <= {0, 1}
    assert OmegaConf.load(tmp_path / "config.yaml").algo.hidden_sizes == [128]  # the MinAtar network


@pytest.mark.slow
@needs_sac
def test_sac_on_mujoco_through_three_ranks_trains_on_float32(tmp_path):
    summary, batch = three_rank_run(tmp_path, "sac", "Hopper-v5", "algo.hidden_sizes=[32,32]")
    assert batch["observation"].dtype == torch.float32 and batch["observation"].shape == (4, 11)
    assert OmegaConf.load(tmp_path / "config.yaml").algo.lr == 3e-4  # SAC's MuJoCo settings


@pytest.mark.slow
def test_atari_training_sees_clipped_rewards_and_life_losses_but_returns_are_game_scores():
    """Space Invaders pays 5 to 30 points an alien and has three lives."""
    settings = {"id": "ALE/SpaceInvaders-v5", "clip_rewards": True, "life_loss": True}
    env = make_env(settings, 2, seed=0)
    torch.manual_seed(0)
    rollout = life_loss_terminal(env.rollout(600, break_when_any_done=False))
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


@pytest.mark.slow
@needs_dqn
def test_atari_evaluation_records_a_video_of_the_game(tmp_path):
    overrides = ["recipe=dqn", "env.id=ALE/Pong-v5", ATARI_SHORT, f"run_dir={tmp_path}"]
    cfg = config.load(overrides, train.DEFAULTS)
    recipe = recipes.load("dqn")
    agent = recipe.Agent(recipe.Config(**OmegaConf.to_container(cfg.algo)), make_env(cfg.env, 1, seed=0))
    checkpoint.save_agent(tmp_path / checkpoint.FINAL, cfg, agent)
    assert evaluate.main([f"checkpoint={tmp_path}", "episodes=1", "video=true"]) == 0
    (video,) = (tmp_path / "videos").glob("*.mp4")
    assert video.stat().st_size > 10_000  # 800 colour frames of the game, not an empty file
    record = json.loads((tmp_path / "evaluation.json").read_text())
    assert record["episodes"] == 1 and -21 <= record["returns"][0] <= 0


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
