"""PPO with the clipped objective and GAE, on-policy in the DD-PPO style.

Schulman et al. (2017), distributed as in Wijmans et al. (2020): there is no replay rank;
every rank collects with its own environments and trains on what it collected, and DDP
averages the gradients of each minibatch over all ranks. Every rank collects the same
number of frames per step, so the ranks always run the same number of minibatches and the
all-reduces pair up however the episodes end. This file owns the actor, the critic, the
advantage estimate and the loss.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.envs import EnvBase
from torchrl.modules import MLP, OneHotCategorical, ProbabilisticActor, ValueOperator
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE

RUN_DEFAULTS = {
    "env": {"id": "CartPole-v1", "num_envs": 8},
    "collector": {"frames_per_batch": 256},
    "total_frames": 200_000,
    # The learning rate decays over the run's whole budget, whatever total_frames is set to.
    "algo": {"lr_decay_frames": "${total_frames}"},
}


@dataclass
class Config:
    """PPO hyperparameters: the SB3 zoo's CartPole setting (8 envs x 32 steps per batch)."""

    hidden_sizes: list[int] = field(default_factory=lambda: [64, 64])
    """units of the hidden layers of the actor and of the critic"""
    lr: float = 1e-3
    """Adam's initial learning rate"""
    # Decayed as in the zoo: held constant, 1e-3 reached 500 on CartPole here and then
    # fell back to about 150 for tens of thousands of frames.
    lr_decay_frames: int | None = None
    """frames (all learners) over which the learning rate falls linearly to 0; null: constant"""
    gamma: float = 0.98
    """discount factor"""
    gae_lambda: float = 0.8
    """GAE's lambda: the bias-variance trade-off of the advantages"""
    clip_epsilon: float = 0.2
    """the clip range of the probability ratio"""
    entropy_coeff: float = 0.0
    """weight of the entropy bonus in the loss"""
    critic_coeff: float = 0.5
    """weight of the value loss in the loss"""
    max_grad_norm: float | None = 0.5
    """the gradients' norm is clipped to this before each step; null: no clipping"""
    epochs: int = 20
    """passes over each collected batch"""
    minibatch_size: int = 256
    """frames per minibatch, per rank"""


class Agent(nn.Module):
    """The actor and the critic, the policy built from them, and the PPO loss.

    The runtime wraps this module in DDP, so ``forward`` computes the loss. Discrete action
    spaces (one-hot, as torchrl's gymnasium wrapper gives them) only.
    """

    uses_replay = False
    action_spaces = ("discrete",)

    def __init__(self, cfg: Config, env: EnvBase) -> None:
        super().__init__()
        self.cfg = cfg
        action_spec = env.action_spec_unbatched
        observations = env.observation_spec["observation"].shape[-1]
        hidden = list(cfg.hidden_sizes)
        self.actor = ProbabilisticActor(
            TensorDictModule(
                MLP(in_features=observations, out_features=action_spec.shape[-1], num_cells=hidden),
                in_keys=["observation"],
                out_keys=["logits"],
            ),
            in_keys=["logits"],
            spec=action_spec,
            distribution_class=OneHotCategorical,
            return_log_prob=True,
        )
        self.critic = ValueOperator(
            MLP(in_features=observations, out_features=1, num_cells=hidden),
            in_keys=["observation"],
        )
        self.advantage = GAE(
            gamma=cfg.gamma, lmbda=cfg.gae_lambda, value_network=self.critic, average_gae=False
        )
        # Frames collected so far, all learners: a buffer, so checkpoints keep it.
        self.register_buffer("frames_seen", torch.zeros((), dtype=torch.long))
        self.lr_schedule: torch.optim.lr_scheduler.LambdaLR | None = None
        self.loss_module = ClipPPOLoss(
            self.actor,
            self.critic,
            clip_epsilon=cfg.clip_epsilon,
            entropy_coeff=cfg.entropy_coeff,
            critic_coeff=cfg.critic_coeff,
            normalize_advantage=True,
        )

    @property
    def policy(self) -> ProbabilisticActor:
        """The collector's policy: samples actions and records their log-probabilities."""
        return self.actor

    def forward(self, batch: TensorDictBase) -> tuple[torch.Tensor, None, dict[str, torch.Tensor]]:
        """Loss on a minibatch that ``after_collect`` gave advantages to (no priorities:
        nothing is replayed)."""
        losses = self.loss_module(batch)
        loss = losses["loss_objective"] + losses["loss_critic"] + losses["loss_entropy"]
        metrics = {
            "loss_objective": losses["loss_objective"].detach(),
            "loss_critic": losses["loss_critic"].detach(),
            "entropy": losses["entropy"].detach(),
        }
        return loss, None, metrics

    def make_optimizers(self) -> dict[str, torch.optim.Optimizer]:
        adam = torch.optim.Adam(self.loss_module.parameters(), lr=self.cfg.lr)
        self.lr_schedule = torch.optim.lr_scheduler.LambdaLR(adam, self.lr_factor)
        return {"adam": adam}

    def lr_factor(self, _) -> float:
        """The fraction of ``lr_decay_frames`` still to collect: the schedule follows frames,
        which ``frames_seen`` counts and checkpoints keep, rather than the scheduler's own
        step count."""
        if not self.cfg.lr_decay_frames:
            return 1.0
        return max(0.0, 1.0 - self.frames_seen.item() / self.cfg.lr_decay_frames)

    @torch.no_grad()
    def after_collect(self, batch: TensorDictBase, frames: int) -> None:
        """Advantages and value targets for the batch just collected, with the critic as it
        was when the batch was collected (GAE runs along the batch's last, time dimension),
        and the learning rate for the updates on it."""
        self.advantage(batch)
        # A batch trains at the rate of the frames collected before it (CleanRL's schedule):
        # the first one at the initial rate, and each step of the scheduler comes after the
        # optimizer's steps on the batch before.
        if self.lr_schedule is not None and self.frames_seen > 0:
            with warnings.catch_warnings():
                # torch warns when a resumed run's scheduler steps before its fresh optimizer
                # has: that would skip a value of a schedule by step count, not of this one.
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
                self.lr_schedule.step()
        self.frames_seen += frames

    def optimizer_step(self, optimizers: dict[str, torch.optim.Optimizer], update: int) -> None:
        """After backward: the gradients' norm clipped (DDP has averaged them already, so
        every learner clips alike), then Adam steps. PPO has no target network."""
        if self.cfg.max_grad_norm is not None:
            nn.utils.clip_grad_norm_(self.parameters(), self.cfg.max_grad_norm)
        optimizers["adam"].step()
