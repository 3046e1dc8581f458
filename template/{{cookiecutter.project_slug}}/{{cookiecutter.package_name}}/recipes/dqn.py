"""DQN with prioritized replay and a target network.

Mnih et al. (2015) with the prioritized replay of Schaul et al. (2016). The runtime owns
collection, replay, DDP and logging; this file owns what is specific to DQN: the Q network
(an MLP for vector observations, the Nature-DQN convolutions for Atari frames, the MinAtar
network for MinAtar grids), epsilon-greedy exploration, the loss and the target network.

The loss is written out below, as CleanRL's ``dqn.py`` writes it. torchrl's ``DQNLoss``
computes the same loss, gradients and priorities through a functional copy of the Q
network, which costs time on a CPU: on MinAtar Breakout, one thread, an update took 3.3
ms with it and its ``HardUpdate``, and 2.0 ms as below, with fused Adam
(docs/benchmarks.md, "Replay recipes against the single-file scripts").
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tensordict import TensorDictBase
from tensordict.nn import TensorDictSequential
from torch import nn
from torchrl.envs import EnvBase
from torchrl.modules import MLP, EGreedyModule, QValueActor

from ._parts import TRANSITION_KEYS, image_encoder, weighted_mean

RUN_DEFAULTS = {
    "env": {"id": "CartPole-v1", "num_envs": 32},
    "collector": {"frames_per_batch": 256},
    "total_frames": 100_000,
}

# The settings of the standard setups of each env family, merged over RUN_DEFAULTS when
# env.id is of that family (config.yaml and the command line still override them). Frames
# are agent steps (an Atari step is 4 emulator frames), summed over the learners.
FAMILY_DEFAULTS = {
    # CleanRL's dqn_atari.py (the Nature DQN's settings): lr 1e-4, batch 32, one update per
    # 4 steps, target copied every 1,000 steps (250 updates), epsilon 1 -> 0.01 over the
    # first 1M of 10M steps, learning from 80k, its life-loss and reward-clipping wrappers.
    # The 1M-transition replay of the paper is replay.capacity=1000000. A learner fetches
    # the 8 batches of a collector step in one request: a request's fixed cost over RPC is
    # spread over twice the frames (Pong, one learner, frames over the socket: 45,000
    # samples/s against 33,000 to 35,000 with 4 per request; docs/distributed.md, "The data path").
    "atari": {
        "env": {"num_envs": 8, "life_loss": True, "clip_rewards": True},
        "replay": {"batches_per_request": 8},
        "collector": {"frames_per_batch": 32},
        "total_frames": 10_000_000,
        "algo": {
            "hidden_sizes": [512],
            "lr": 1e-4,
            "batch_size": 32,
            "updates_per_batch": 8,
            "learning_starts": 80_000,
            "eps_end": 0.01,
            "eps_frames": 1_000_000,
            "target_update_period": 250,
        },
    },
    # The MinAtar paper's DQN (Young & Tian 2019): batch 32, one update per step, target
    # copied every 1,000 updates, epsilon 1 -> 0.1 over 100k steps, learning from 5,000,
    # 5M steps, a 100k replay (config.yaml's); Adam at its RMSProp's 2.5e-4. Its replay is
    # uniform, and so is this one: prioritized, Freeway-v0 scored 12.6 after 600k frames;
    # uniform, 34.8 after 100k (benchmarks/learning.py, docs/benchmarks.md).
    "minatar": {
        "env": {"num_envs": 8},
        "replay": {"alpha": 0.0},
        "collector": {"frames_per_batch": 32},
        "total_frames": 5_000_000,
        "algo": {
            "hidden_sizes": [128],
            "lr": 2.5e-4,
            "batch_size": 32,
            "updates_per_batch": 32,
            "learning_starts": 5_000,
            "eps_end": 0.1,
            "eps_frames": 100_000,
            "target_update_period": 1_000,
        },
    },
}


@dataclass
class Config:
    """DQN hyperparameters. Frame counts are summed over all learner ranks."""

    hidden_sizes: list[int] = field(default_factory=lambda: [256, 256])
    """units of the Q network's hidden layers (after the convolutions, for images)"""
    lr: float = 2.3e-3
    """Adam's learning rate"""
    gamma: float = 0.99
    """discount factor"""
    batch_size: int = 64
    """transitions per update, all learners together (learners.batch_size_of)"""
    # Gradient updates after each collector batch (256 frames per learner by default):
    # each frame is replayed 32 times on average, as in the SB3 zoo's setting.
    updates_per_batch: int = 128
    """gradient updates per collector batch (frames_per_batch), all learners together"""
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
    action_spaces = ("discrete",)
    batch_keys = TRANSITION_KEYS

    def __init__(self, cfg: Config, env: EnvBase) -> None:
        super().__init__()
        self.cfg = cfg
        self.action_spec = env.action_spec
        observation_shape = env.observation_spec_unbatched["observation"].shape
        self.q_network = make_q_network(observation_shape, self.action_spec.shape[-1], list(cfg.hidden_sizes))
        # Not trained: a copy of the Q network, refreshed every target_update_period updates.
        self.target_network = copy.deepcopy(self.q_network).requires_grad_(False)
        self.exploration = EGreedyModule(
            self.action_spec,
            eps_init=cfg.eps_init,
            eps_end=cfg.eps_end,
            annealing_num_steps=cfg.eps_frames,
        )

    @property
    def policy(self) -> TensorDictSequential:
        """The collector's policy: the Q network's greedy action, random with probability
        epsilon (greedy evaluation leaves the exploration out)."""
        actor = QValueActor(self.q_network, in_keys=["observation"], spec=self.action_spec)
        return TensorDictSequential(actor, self.exploration)

    def forward(self, batch: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The Huber loss of the Q values of the actions taken against their one-step
        targets, each transition weighted by its importance weight; and each transition's
        new priority, its squared TD error (``DQNLoss``'s, with which the figures in
        docs/benchmarks.md were measured)."""
        reward = batch["next", "reward"].squeeze(-1)
        terminated = batch["next", "terminated"].squeeze(-1)
        weight = batch.get("priority_weight", torch.ones_like(reward))
        with torch.no_grad():
            next_q = self.target_network(batch["next", "observation"]).max(-1).values
            target = reward + self.cfg.gamma * (~terminated) * next_q
        # Actions are one-hot: the Q value of the action taken is a masked sum.
        q = (self.q_network(batch["observation"]) * batch["action"]).sum(-1)
        loss = weighted_mean(F.smooth_l1_loss(q, target, reduction="none"), weight)
        metrics = {"loss": loss.detach(), "epsilon": self.exploration.eps.detach()}
        return loss, (q.detach() - target).pow(2), metrics

    def make_optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """Adam; ``fused``: one kernel per step instead of several per tensor."""
        return {"adam": torch.optim.Adam(self.q_network.parameters(), lr=self.cfg.lr, fused=True)}

    def after_collect(self, batch: TensorDictBase, frames: int, sum_over_learners: Callable) -> None:
        """Anneal epsilon by the frames all learners collected in this step, in closed form:
        ``EGreedyModule.step(frames)`` loops once per frame. Epsilon is a buffer of the
        exploration module, so checkpoints keep it."""
        cfg = self.cfg
        decay = frames * (cfg.eps_init - cfg.eps_end) / cfg.eps_frames
        eps = self.exploration.eps
        eps.copy_((eps - decay).clamp(min=cfg.eps_end))

    def optimizer_step(self, optimizers: dict[str, torch.optim.Optimizer], update: int) -> None:
        """After backward: Adam steps, and every ``target_update_period`` updates the Q
        network is copied into the target."""
        optimizers["adam"].step()
        if update % self.cfg.target_update_period == 0:
            self.target_network.load_state_dict(self.q_network.state_dict())


def make_q_network(observation_shape: torch.Size, actions: int, hidden_sizes: list[int]) -> nn.Module:
    """An MLP for vector observations. For images ``(channels, height, width)``: the
    Nature-DQN convolutions for Atari's frames or the MinAtar network's one for MinAtar's
    grids (``image_encoder``), then ``hidden_sizes`` fully connected units (512 and 128 in
    the papers)."""
    if len(observation_shape) == 1:
        return MLP(observation_shape[0], actions, num_cells=hidden_sizes, activation_class=nn.ReLU)
    encoder, features = image_encoder(observation_shape)
    head = MLP(features, actions, num_cells=hidden_sizes, activation_class=nn.ReLU)
    return nn.Sequential(*encoder, head)
