"""Greedy evaluation: the policy without exploration noise, on fresh environments.

Evaluation plays whole episodes of the env as the run's ``env`` config makes it (the same
family preprocessing and vector backend as training), with raw rewards and no life-loss
terminal: the returns are game scores.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from tensordict.nn import TensorDictModuleBase
from torchrl.envs.utils import ExplorationType, set_exploration_type

from .envs import make_env, make_video_env, max_episode_steps


def evaluate(
    policy: TensorDictModuleBase, env: Mapping[str, Any], episodes: int, seed: int, device: torch.device
) -> list[float]:
    """Returns of ``episodes`` greedy episodes, run side by side as one batch of envs.

    The rollout stops once every copy has finished its first episode (torchrl's partial
    steps stop stepping a copy that is done). torchrl still hands a finished copy's action
    to gymnasium, which refuses it unless it resets copies itself: same-step autoreset
    (``make_env(training=False)``).
    """
    # Evaluating leaves training's random numbers as they were: torchrl's GymWrapper draws
    # from torch's generator as it checks a new env's specs, and how often a run evaluated
    # would otherwise change what it learned.
    with torch.random.fork_rng(devices=[]):
        eval_env = make_env(env, episodes, seed, device, training=False, policy=policy)
        try:
            with torch.no_grad(), set_exploration_type(ExplorationType.DETERMINISTIC):
                rollout = eval_env.rollout(
                    max_episode_steps(env["id"]), policy, break_when_any_done=False, break_when_all_done=True
                )
        finally:
            eval_env.close()
    done = rollout["next", "done"].squeeze(-1)
    reward = rollout["next", "reward"].squeeze(-1)
    # Each env's first episode ends at its first done (or is cut at max_steps).
    last = torch.where(done.any(-1), done.float().argmax(-1), done.shape[-1] - 1)
    in_episode = torch.arange(done.shape[-1], device=done.device) <= last.unsqueeze(-1)
    return reward.where(in_episode, 0.0).sum(-1).tolist()


def record(
    policy: TensorDictModuleBase, env: Mapping[str, Any], episodes: int, seed: int, folder: Path
) -> list[float]:
    """Returns of ``episodes`` greedy episodes played one at a time, each recorded to an
    mp4 in ``folder`` by gymnasium's ``RecordVideo`` (needs moviepy, and pygame for the
    classic-control environments)."""
    # Off-screen rendering needs no display: without these, pygame greets on stdout and SDL
    # complains about the missing display on headless machines.
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")
    video_env = make_video_env(env, str(folder), seed, policy)
    returns = []
    try:
        with torch.no_grad(), set_exploration_type(ExplorationType.DETERMINISTIC):
            for _ in range(episodes):
                rollout = video_env.rollout(max_episode_steps(env["id"]), policy)
                returns.append(float(rollout["next", "reward"].sum()))
    finally:
        video_env.close()
    return returns
