"""DQN with prioritized replay and a target network.

Mnih et al. (2015) with the prioritized replay of Schaul et al. (2016). The runtime owns
collection, replay, DDP and logging; this file owns what is specific to DQN: the Q network,
epsilon-greedy exploration, the loss and the target network.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictSequential
from torch import nn
from torchrl.envs import EnvBase
from torchrl.modules import MLP, EGreedyModule, QValueActor
from torchrl.objectives import DQNLoss, HardUpdate

RUN_DEFAULTS = {
    "env": {"id": "CartPole-v1", "num_envs": 32},
    "collector": {"frames_per_batch": 256},
    "total_frames": 100_000,
}


@dataclass
class Config:
    """DQN hyperparameters. Frame counts are summed over all learner ranks."""

    hidden_sizes: list[int] = field(default_factory=lambda: [256, 256])
    """units of the Q network's hidden layers"""
    lr: float = 2.3e-3
    """Adam's learning rate"""
    gamma: float = 0.99
    """discount factor"""
    batch_size: int = 64
    """transitions per prioritized sample, per learner and update"""
    # Gradient updates after each collector batch (256 frames per learner by default):
    # each frame is replayed 32 times on average, as in the SB3 zoo's setting.
    updates_per_batch: int = 128
    """gradient updates per learner after each collector batch"""
    learning_starts: int = 1000
    """frames (all learners) collected before the first update"""
    eps_init: float = 1.0
    """exploration: the probability of a random action at the start"""
    eps_end: float = 0.04
    """exploration: the probability of a random action after eps_frames"""
    eps_frames: int = 16_000
    """frames (all learners) over which epsilon falls linearly from eps_init to eps_end"""
    # Updates between target-network copies: once per collector batch, which is what the
    # SB3 zoo's setting amounts to (its target is refreshed while collecting).
    target_update_period: int = 128
    """updates between copies of the Q network into the target network"""


class Agent(nn.Module):
    """Everything DQN learns, plus the policies built from it.

    The runtime wraps this module in DDP, so ``forward`` computes the loss: DDP
    all-reduces the gradients of every parameter registered here.
    """

    uses_replay = True
    batch_keys = (
        "observation",
        "action",
        ("next", "observation"),
        ("next", "reward"),
        ("next", "done"),
        ("next", "terminated"),
    )
    priority_key = "td_error"

    def __init__(self, cfg: Config, env: EnvBase) -> None:
        super().__init__()
        self.cfg = cfg
        action_spec = env.action_spec
        q_network = MLP(
            in_features=env.observation_spec["observation"].shape[-1],
            out_features=action_spec.shape[-1],
            num_cells=list(cfg.hidden_sizes),
            activation_class=nn.ReLU,
        )
        self.actor = QValueActor(q_network, in_keys=["observation"], spec=action_spec)
        self.exploration = EGreedyModule(
            action_spec,
            eps_init=cfg.eps_init,
            eps_end=cfg.eps_end,
            annealing_num_steps=cfg.eps_frames,
        )
        self.loss_module = DQNLoss(
            self.actor,
            loss_function="smooth_l1",
            delay_value=True,
            action_space=action_spec,
        )
        self.loss_module.make_value_estimator(gamma=cfg.gamma)
        self.target_updater = HardUpdate(
            self.loss_module, value_network_update_interval=cfg.target_update_period
        )

    @property
    def policy(self) -> TensorDictSequential:
        """The collector's policy: greedy actions with epsilon-random exploration."""
        return TensorDictSequential(self.actor, self.exploration)

    def forward(self, batch: TensorDictBase) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss on a sampled batch. DQNLoss writes ``td_error`` into ``batch`` in place."""
        loss = self.loss_module(batch)["loss"]
        return loss, {"loss": loss.detach(), "epsilon": self.exploration.eps.detach()}

    def make_optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"adam": torch.optim.Adam(self.loss_module.parameters(), lr=self.cfg.lr)}

    def optimizers_to_step(self, update: int) -> list[str]:
        return ["adam"]

    def after_collect(self, batch: TensorDictBase, frames: int) -> None:
        """Anneal epsilon by the frames all learners collected in this step, in closed form:
        ``EGreedyModule.step(frames)`` loops once per frame. Epsilon is a buffer of the
        exploration module, so checkpoints keep it."""
        cfg = self.cfg
        decay = frames * (cfg.eps_init - cfg.eps_end) / cfg.eps_frames
        eps = self.exploration.eps
        eps.copy_((eps - decay).clamp(min=cfg.eps_end))

    def after_update(self, update: int) -> None:
        """HardUpdate counts the updates itself and copies every ``target_update_period``."""
        self.target_updater.step()
