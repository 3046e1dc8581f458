"""TD3 with prioritized replay: twin critics, target policy smoothing and a delayed actor.

Fujimoto et al. (2018). The runtime owns collection, replay, DDP and logging; this file
owns the deterministic actor and its exploration noise, the twin critics, the loss, the
update schedule (the actor and the target networks move every ``policy_delay`` updates)
and the Polyak-averaged targets. Hyperparameters are CleanRL's ``td3_continuous_action.py``
for MuJoCo (``recipe=td3 env.id=Hopper-v5``, with the ``[mujoco]`` extra); the run
defaults are a short Pendulum run that needs no extra.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule, TensorDictSequential
from torch import nn
from torchrl.envs import EnvBase
from torchrl.modules import MLP, AdditiveGaussianModule, TanhModule, ValueOperator
from torchrl.objectives import SoftUpdate, TD3Loss

RUN_DEFAULTS = {
    "env": {"id": "Pendulum-v1", "num_envs": 4},
    "collector": {"frames_per_batch": 64},
    "total_frames": 30_000,
    # CleanRL's 25,000 random frames are for million-frame MuJoCo runs.
    "algo": {"learning_starts": 1000, "random_frames": 1000},
}
FAMILY_DEFAULTS = {
    # CleanRL's td3_continuous_action.py: 1M steps, 25,000 of them random before learning
    # (the Config's defaults are its other values); 4 envs of 16 steps per learner and
    # batch, one update per frame collected.
    "mujoco": {
        "env": {"num_envs": 4},
        "collector": {"frames_per_batch": 64},
        "total_frames": 1_000_000,
        "algo": {"learning_starts": 25_000, "random_frames": 25_000},
    },
}


@dataclass
class Config:
    """TD3 hyperparameters (CleanRL's td3_continuous_action.py). Frame counts are summed
    over all learner ranks."""

    hidden_sizes: list[int] = field(default_factory=lambda: [256, 256])
    """units of the hidden layers of the actor and of each critic"""
    lr: float = 3e-4
    """Adam's learning rate, for the actor and the critics"""
    gamma: float = 0.99
    """discount factor"""
    batch_size: int = 256
    """transitions per prioritized sample, per learner and update"""
    # One update per frame this learner collected: CleanRL's one gradient step per env step.
    updates_per_batch: int = 64
    """gradient updates per learner after each collector batch"""
    learning_starts: int = 25_000
    """frames (all learners) collected before the first update"""
    # A deterministic actor with a little noise would fill replay with a narrow band of
    # near-identical actions; CleanRL and the TD3 paper explore uniformly at first.
    random_frames: int = 25_000
    """frames (all learners) collected with uniformly random actions before the actor acts"""
    tau: float = 0.005
    """Polyak averaging rate of the target networks, per actor update"""
    policy_delay: int = 2
    """updates per actor update: the critics train at every update, the actor and the
    targets at every policy_delay-th"""
    exploration_noise: float = 0.1
    """standard deviation of the collector's Gaussian action noise, in half action ranges"""
    policy_noise: float = 0.2
    """standard deviation of the target policy's smoothing noise"""
    noise_clip: float = 0.5
    """the target policy's smoothing noise is clipped to plus or minus this"""


class Agent(nn.Module):
    """The actor and the twin critics (inside ``TD3Loss``, which also holds their targets)."""

    uses_replay = True
    action_spaces = ("continuous",)
    batch_keys = (
        "observation",
        "action",
        ("next", "observation"),
        ("next", "reward"),
        ("next", "done"),
        ("next", "terminated"),
    )

    def __init__(self, cfg: Config, env: EnvBase) -> None:
        super().__init__()
        self.cfg = cfg
        action_spec = env.action_spec_unbatched
        observations = env.observation_spec["observation"].shape[-1]
        actions = action_spec.shape[-1]
        hidden = list(cfg.hidden_sizes)
        self.actor = TensorDictSequential(
            TensorDictModule(
                MLP(
                    in_features=observations, out_features=actions, num_cells=hidden, activation_class=nn.ReLU
                ),
                in_keys=["observation"],
                out_keys=["action_preactivation"],
            ),
            TanhModule(in_keys=["action_preactivation"], out_keys=["action"], spec=action_spec),
        )
        half_range = ((action_spec.space.high - action_spec.space.low) / 2).tolist()
        # Noise only while the collector explores: greedy evaluation (deterministic mode) acts
        # with the actor alone.
        self.exploration = AdditiveGaussianModule(
            action_spec,
            sigma_init=cfg.exploration_noise,
            sigma_end=cfg.exploration_noise,
            std=half_range,
        )
        critic = ValueOperator(
            MLP(
                in_features=observations + actions, out_features=1, num_cells=hidden, activation_class=nn.ReLU
            ),
            in_keys=["observation", "action"],
        )
        self.loss_module = TD3Loss(
            self.actor,
            critic,
            action_spec=action_spec,
            num_qvalue_nets=2,
            policy_noise=cfg.policy_noise,
            noise_clip=cfg.noise_clip,
            loss_function="l2",
        )
        self.loss_module.make_value_estimator(gamma=cfg.gamma)
        self.target_updater = SoftUpdate(self.loss_module, tau=cfg.tau)

    @property
    def policy(self) -> TensorDictSequential:
        """The collector's policy: the actor's action plus Gaussian noise."""
        return TensorDictSequential(self.actor, self.exploration)

    def forward(self, batch: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Loss on a sampled batch: the critics' and the actor's, at every update; and each
        transition's new priority.

        The actor's loss is part of every update although the actor moves every
        ``policy_delay`` updates only: each learner then all-reduces the same gradients at
        every update, as DDP requires, and ``optimizer_step`` leaves the actor's optimizer
        out when it must not move. TD3Loss detaches the critics in the actor's loss, so the
        critics learn from their own loss only.
        """
        losses = self.loss_module(batch)
        loss = losses["loss_actor"] + losses["loss_qvalue"]
        # TD3Loss writes squared TD errors into batch; prioritized replay ranks by their magnitude.
        priorities = batch["td_error"].sqrt()
        return loss, priorities, {key: losses[key].detach() for key in ("loss_actor", "loss_qvalue")}

    def make_optimizers(self) -> dict[str, torch.optim.Optimizer]:
        loss_module, lr = self.loss_module, self.cfg.lr
        return {
            "critics": torch.optim.Adam(loss_module.qvalue_network_params.parameters(), lr=lr),
            "actor": torch.optim.Adam(loss_module.actor_network_params.parameters(), lr=lr),
        }

    def after_collect(self, batch: TensorDictBase, frames: int, sum_over_learners: Callable) -> None:
        """Nothing to do: the exploration noise is constant."""

    def optimizer_step(self, optimizers: dict[str, torch.optim.Optimizer], update: int) -> None:
        """After backward: the critics step at every update; the actor, and the targets
        after it, every ``policy_delay`` updates. A zero gradient would not hold the actor
        still: Adam's momentum would move it anyway."""
        optimizers["critics"].step()
        if update % self.cfg.policy_delay == 0:
            optimizers["actor"].step()
            self.target_updater.step()
