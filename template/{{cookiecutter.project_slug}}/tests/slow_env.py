"""An environment with a simulator's pace but not its CPU: CartPole whose every step sleeps
``step_s`` seconds (``env.kwargs.step_s``). A run that must last a while in wall time (the
SLURM job that has to outlive its time limit's warning) trains on it without taking the
cores from the tests that run beside it. train.py reaches it through gymnasium's
``module:EnvId`` form of ``env.id``."""

from __future__ import annotations

import time

import gymnasium as gym
from gymnasium.envs.classic_control import CartPoleEnv


class SlowCartPole(CartPoleEnv):
    def __init__(self, step_s: float = 0.01, **kwargs) -> None:
        super().__init__(**kwargs)
        self.step_s = step_s

    def step(self, action):
        time.sleep(self.step_s)
        return super().step(action)


if "SlowCartPole-v1" not in gym.registry:
    gym.register("SlowCartPole-v1", SlowCartPole, max_episode_steps=500)
