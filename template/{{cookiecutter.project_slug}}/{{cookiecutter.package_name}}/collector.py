"""Environments and the collector that steps them with the learner's own policy."""

from __future__ import annotations

import gymnasium as gym
import torch
from tensordict.nn import TensorDictModuleBase
from torchrl.collectors import Collector
from torchrl.envs import EnvBase, GymWrapper, RewardSum


def make_env(env_id: str, num_envs: int, seed: int, device: torch.device | str = "cpu") -> EnvBase:
    """``num_envs`` copies of ``env_id`` stepped as one batch in this process.

    gymnasium's synchronous vector env avoids the subprocesses of ``GymEnv(num_envs=N)``,
    which are slower for cheap environments; torchrl accepts only same-step autoreset.
    ``RewardSum`` adds ``episode_reward`` so returns can be read off any batch.
    """
    vector_env = gym.make_vec(
        env_id,
        num_envs=num_envs,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
    )
    env = GymWrapper(vector_env, device=device)  # already a TransformedEnv: append to it
    env.append_transform(RewardSum())
    env.set_seed(seed)
    return env


def make_collector(
    env: EnvBase, policy: TensorDictModuleBase, frames_per_batch: int, total_frames: int, device: torch.device
) -> Collector:
    """A collector in this process that shares the policy's parameters, so it always acts
    with the latest weights and no weights are ever copied."""
    return Collector(
        env,
        policy,
        frames_per_batch=frames_per_batch,
        total_frames=total_frames,
        policy_device=device,
        env_device="cpu",
        storing_device="cpu",
        auto_register_policy_transforms=False,
    )
