"""Greedy evaluation: the policy without exploration noise, on fresh environments."""

from __future__ import annotations

import os
from pathlib import Path

import gymnasium as gym
import torch
from tensordict.nn import TensorDictModuleBase
from torchrl.envs.utils import ExplorationType, set_exploration_type

from .collector import as_torchrl

MAX_EPISODE_STEPS = 10_000


def evaluate(
    policy: TensorDictModuleBase, env_id: str, episodes: int, seed: int, device: torch.device
) -> list[float]:
    """Returns of ``episodes`` greedy episodes, run side by side as one batch of envs.

    The rollout stops once every copy has finished its first episode (torchrl's partial
    steps stop stepping a copy that is done). torchrl still hands a finished copy's action
    to gymnasium, which refuses it unless it resets copies itself: same-step autoreset.
    """
    vector_env = gym.make_vec(
        env_id,
        num_envs=episodes,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
    )
    env = as_torchrl(vector_env, seed, device)
    # The spec gymnasium made the env from: gym.spec() refuses the ``module:EnvId`` form.
    max_steps = vector_env.spec.max_episode_steps or MAX_EPISODE_STEPS
    try:
        with torch.no_grad(), set_exploration_type(ExplorationType.DETERMINISTIC):
            rollout = env.rollout(max_steps, policy, break_when_any_done=False, break_when_all_done=True)
    finally:
        env.close()
    done = rollout["next", "done"].squeeze(-1)
    returns = rollout["next", "episode_reward"].squeeze(-1)
    # Each env's first episode ends at its first done (or is cut at max_steps).
    last = torch.where(done.any(-1), done.float().argmax(-1), done.shape[-1] - 1)
    return returns.gather(-1, last.unsqueeze(-1)).squeeze(-1).tolist()


def record(policy: TensorDictModuleBase, env_id: str, episodes: int, seed: int, folder: Path) -> list[float]:
    """Returns of ``episodes`` greedy episodes played one at a time, each recorded to an
    mp4 in ``folder`` by gymnasium's ``RecordVideo`` (needs moviepy, and pygame for the
    classic-control environments)."""
    # Off-screen rendering needs no display: without these, pygame greets on stdout and SDL
    # complains about the missing display on headless machines.
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")
    recorder = gym.wrappers.RecordVideo(
        gym.make(env_id, render_mode="rgb_array"),
        str(folder),
        # Episode 0 is the reset with which torchrl seeds the env: not an episode played.
        episode_trigger=lambda episode: episode > 0,
        name_prefix=env_id,
        disable_logger=True,
    )
    env = as_torchrl(recorder, seed)
    max_steps = recorder.spec.max_episode_steps or MAX_EPISODE_STEPS
    returns = []
    try:
        with torch.no_grad(), set_exploration_type(ExplorationType.DETERMINISTIC):
            for _ in range(episodes):
                rollout = env.rollout(max_steps, policy)
                returns.append(float(rollout["next", "episode_reward"][-1]))
    finally:
        env.close()
    return returns
