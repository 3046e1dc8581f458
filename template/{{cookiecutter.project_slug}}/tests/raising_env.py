"""A user's environment that breaks: CartPole whose ``step`` or ``reset`` raises once this
process has taken ``after`` steps (``env.kwargs.fail_in=step``, or ``reset``). train.py
reaches it through gymnasium's ``module:EnvId`` form of ``env.id``."""

from __future__ import annotations

import gymnasium as gym
from gymnasium.envs.classic_control import CartPoleEnv

STEPS = [0]  # steps taken in this process, by every copy


class BrokenCartPole(CartPoleEnv):
    def __init__(self, fail_in: str = "step", after: int = 300, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fail_in, self.after = fail_in, after

    def step(self, action):
        STEPS[0] += 1
        if self.fail_in == "step" and STEPS[0] > self.after:
            raise ValueError("the environment broke in step")
        return super().step(action)

    def reset(self, **kwargs):
        if self.fail_in == "reset" and STEPS[0] > self.after:
            raise ValueError("the environment broke in reset")
        return super().reset(**kwargs)


if "BrokenCartPole-v1" not in gym.registry:
    gym.register("BrokenCartPole-v1", BrokenCartPole, max_episode_steps=500)
