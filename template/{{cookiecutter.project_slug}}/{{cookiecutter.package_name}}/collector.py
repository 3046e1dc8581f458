"""Environments, and the collector that steps them with the learner's own policy."""

from __future__ import annotations

from collections.abc import Iterator

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torchrl.envs import EnvBase, GymWrapper, RewardSum
from torchrl.envs.utils import ExplorationType, set_exploration_type


def make_env(env_id: str, num_envs: int, seed: int, device: torch.device | str = "cpu") -> EnvBase:
    """``num_envs`` copies of ``env_id`` stepped as one batch in this process, as a torchrl env.

    gymnasium's synchronous vector env avoids the subprocesses of ``GymEnv(num_envs=N)``,
    which are slower for cheap environments; torchrl accepts only same-step autoreset.
    ``RewardSum`` (see ``as_torchrl``) adds ``episode_reward`` so returns can be read off
    any rollout.
    """
    vector_env = gym.make_vec(
        env_id,
        num_envs=num_envs,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
    )
    return as_torchrl(vector_env, seed, device)


def as_torchrl(gym_env: gym.Env, seed: int, device: torch.device | str = "cpu") -> EnvBase:
    """A gymnasium env as a seeded torchrl env with ``episode_reward``."""
    # A wrapped vector env is already a TransformedEnv and appends in place; any other env
    # comes back wrapped in a new one: use what append_transform returns.
    env = GymWrapper(gym_env, device=device).append_transform(RewardSum())
    env.set_seed(seed)
    return env


class VectorCollector:
    """Steps the vector env behind ``env`` (from ``make_env``) with ``policy`` and yields
    batches of ``frames_per_batch`` frames, shaped ``[num_envs, steps]`` in torchrl's layout:
    ``observation``, the policy's outputs (``action``, ...), and under ``next`` the
    ``observation``, ``reward``, ``done``, ``terminated``, ``truncated`` and
    ``episode_reward``, as torchrl's ``Collector`` with a ``RewardSum`` would give them.

    Why not torchrl's ``Collector``: on a batch of CartPoles its env wrapper, transforms and
    step bookkeeping cost about 2 ms of Python per step, while gymnasium steps 8 copies in
    0.1 ms; it reached 0.11 of a plain gymnasium loop's frames/s (benchmarks/collection.py).
    Here each step is one policy call and one gymnasium step, and torchrl's wrapper is used
    only to translate actions and observations. The policy shares the learner's
    parameters, so it always acts with the latest weights and nothing is copied.
    """

    def __init__(
        self,
        env: EnvBase,
        policy: TensorDictModuleBase,
        frames_per_batch: int,
        total_frames: int,
        device: torch.device,
    ) -> None:
        self.wrapper = env.base_env
        # GymWrapper keeps the gymnasium env it wraps as `_env`: stepping that directly is
        # the point of this class. tests/test_collector.py fails if torchrl moves it.
        self.envs: gym.vector.VectorEnv = self.wrapper._env
        self.policy = policy
        self.num_envs = self.envs.num_envs
        self.steps_per_batch = frames_per_batch // self.num_envs
        self.total_frames = total_frames
        self.device = device
        # make_env seeded the envs; this reset continues their seeded generators.
        self._observation = self.wrapper.read_obs(self.envs.reset()[0])
        self._episode_reward = np.zeros(self.num_envs)

    def __iter__(self) -> Iterator[TensorDictBase]:
        frames = 0
        while frames < self.total_frames:
            yield self.collect()
            frames += self.steps_per_batch * self.num_envs

    @torch.no_grad()
    def collect(self) -> TensorDictBase:
        """One batch. Per step only the policy call, the env step and list appends run;
        tensors are stacked and converted once per batch."""
        acted, next_observations = [], []
        rewards, terminated, truncated, episode_rewards = [], [], [], []
        with set_exploration_type(ExplorationType.RANDOM):
            for _ in range(self.steps_per_batch):
                td = TensorDict(self._observation, [self.num_envs])
                if self.device.type != "cpu":
                    td = self.policy(td.to(self.device)).to("cpu")
                else:
                    td = self.policy(td)
                acted.append(td)
                observation, reward, ended, cut, info = self.envs.step(self.wrapper.read_action(td["action"]))
                self._observation = self.wrapper.read_obs(observation)
                if "final_obs" in info:
                    # Same-step autoreset returned the first observation of the next
                    # episode for the envs that finished; the transition needs the last
                    # observation of the episode that ended.
                    next_observations.append(
                        self.wrapper.read_obs(self._last_observations(observation, info))
                    )
                else:
                    next_observations.append(self._observation)
                self._episode_reward += reward
                rewards.append(reward)
                terminated.append(ended)
                truncated.append(cut)
                episode_rewards.append(self._episode_reward.copy())
                self._episode_reward[ended | cut] = 0.0

        def stacked(arrays: list[np.ndarray], dtype: torch.dtype) -> torch.Tensor:
            return torch.as_tensor(np.stack(arrays, axis=1), dtype=dtype).unsqueeze(-1)

        batch = torch.stack(acted, dim=1)
        ended, cut = stacked(terminated, torch.bool), stacked(truncated, torch.bool)
        batch["next"] = torch.stack([TensorDict(o, [self.num_envs]) for o in next_observations], dim=1)
        batch["next"].update(
            {
                "reward": stacked(rewards, torch.float32),
                "done": ended | cut,
                "terminated": ended,
                "truncated": cut,
                "episode_reward": stacked(episode_rewards, torch.float32),
            }
        )
        return batch

    def _last_observations(self, observation, info: dict):
        rows = gym.vector.utils.iterate(self.envs.observation_space, observation)
        finished = zip(info["final_obs"], info["_final_obs"], strict=True)
        last = [final if done else row for row, (final, done) in zip(rows, finished, strict=True)]
        space = self.envs.single_observation_space
        return gym.vector.utils.concatenate(
            space, last, gym.vector.utils.create_empty_array(space, len(last))
        )

    def shutdown(self) -> None:
        self.envs.close()
