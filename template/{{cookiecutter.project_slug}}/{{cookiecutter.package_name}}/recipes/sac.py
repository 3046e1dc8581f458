"""Soft actor-critic with prioritized replay, twin Q networks and a learned temperature.

Haarnoja et al. (2018), the version with automatic entropy tuning. The runtime owns
collection, replay, DDP and logging; this file owns the tanh-Gaussian actor, the twin
critics, the loss and the Polyak-averaged target critics.

The loss is written out below, as CleanRL's ``sac_continuous_action.py`` writes it. torchrl's
``SACLoss`` computes the same losses and gradients through functional copies of the
critics, which costs time on a CPU: on one thread, 256x256 networks and batch 256, an
update took 11.7 ms with it and 8.5 ms as below, with fused Adam (docs/benchmarks.md, "Replay
recipes against the single-file scripts").
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tensordict import TensorDictBase
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torch import nn
from torchrl.envs import EnvBase
from torchrl.modules import MLP, ProbabilisticActor, TanhNormal

from ._parts import TRANSITION_KEYS, frozen, polyak, smaller_q, td_errors, twin_critics, weighted_mean

RUN_DEFAULTS = {
    "env": {"id": "Pendulum-v1", "num_envs": 4},
    "collector": {"frames_per_batch": 64},
    "total_frames": 30_000,
}

# The settings of the standard setups of each env family, merged over RUN_DEFAULTS when
# env.id is of that family (config.yaml and the command line still override them).
FAMILY_DEFAULTS = {
    # CleanRL's sac_continuous_action.py on MuJoCo: 256x256 networks, batch 256, one update
    # per step, learning from 5,000 steps, tau 0.005, 1M steps; Adam at 3e-4 for the actor
    # and 1e-3 for the critics and the temperature. Its replay is uniform, and so is this
    # one: over 3 seeds of 100k frames, prioritized, Hopper-v5's training returns ended at
    # a mean of 575, uniform 1,527; HalfCheetah-v5's greedy 6,067 and 5,851, within each
    # other's spread (docs/benchmarks.md).
    "mujoco": {
        "env": {"num_envs": 4},
        "replay": {"alpha": 0.0},
        "collector": {"frames_per_batch": 64},
        "total_frames": 1_000_000,
        "algo": {
            "hidden_sizes": [256, 256],
            "lr": 3e-4,
            "q_lr": 1e-3,
            "batch_size": 256,
            "updates_per_batch": 64,
            "learning_starts": 5_000,
        },
    },
}


@dataclass
class Config:
    """SAC hyperparameters (the SB3 zoo's Pendulum setting). Frame counts are summed over
    all learner ranks."""

    # The zoo's 256 units cost 1.4 times the time per update on CPU here (37 against 53
    # updates/s per learner on 3 ranks) and reached -200 at the same frame (6,016, seed 1).
    hidden_sizes: list[int] = field(default_factory=lambda: [128, 128])
    """units of the hidden layers of the actor and of each critic"""
    lr: float = 1e-3
    """Adam's learning rate for the actor"""
    q_lr: float = 1e-3
    """Adam's learning rate for the critics and the temperature"""
    gamma: float = 0.99
    """discount factor"""
    batch_size: int = 256
    """transitions per update, all learners together (learners.batch_size_of)"""
    # One update per frame collected: the zoo's one gradient step per env step.
    updates_per_batch: int = 64
    """gradient updates per collector batch (frames_per_batch), all learners together"""
    learning_starts: int = 1000
    """frames (all learners) collected before the first update"""
    tau: float = 0.005
    """Polyak averaging rate of the target critics, per update"""
    alpha_init: float = 1.0
    """initial entropy temperature (learned from there)"""


class Agent(nn.Module):
    """The actor, the twin critics and their targets, and the temperature.

    The runtime wraps this module in DDP, so ``forward`` computes the loss. The temperature
    (``log_alpha``) is a parameter like the networks': DDP all-reduces its gradient too, so
    it stays the same on every learner. The target critics are not trained (no gradient):
    they follow the critics in ``optimizer_step``.
    """

    uses_replay = True
    action_spaces = ("continuous",)
    batch_keys = TRANSITION_KEYS

    def __init__(self, cfg: Config, env: EnvBase) -> None:
        super().__init__()
        self.cfg = cfg
        # The env is a batch of copies; the actor wants one copy's action space.
        action_spec = env.action_spec_unbatched
        observations = env.observation_spec["observation"].shape[-1]
        actions = action_spec.shape[-1]
        hidden = list(cfg.hidden_sizes)
        # The actor's network: each action's mean and scale, for a tanh-squashed Normal
        # between the bounds. The bounds are buffers, so they move to the learner's device
        # with the agent: a CUDA graph of the update cannot copy them there from the CPU.
        self.actor = nn.Sequential(
            MLP(
                in_features=observations, out_features=2 * actions, num_cells=hidden, activation_class=nn.ReLU
            ),
            NormalParamExtractor(),
        )
        self.action_spec = action_spec
        self.register_buffer("low", action_spec.space.low.clone())
        self.register_buffer("high", action_spec.space.high.clone())
        self.critics = twin_critics(observations, actions, hidden)
        self.target_critics = copy.deepcopy(self.critics).requires_grad_(False)
        self.log_alpha = nn.Parameter(torch.tensor(math.log(cfg.alpha_init)))
        self.target_entropy = -float(actions)  # the paper's: minus the action's dimensions

    @property
    def policy(self) -> ProbabilisticActor:
        """The collector's policy: samples from the actor (greedy evaluation takes its mode)."""
        return ProbabilisticActor(
            TensorDictModule(self.actor, in_keys=["observation"], out_keys=["loc", "scale"]),
            in_keys=["loc", "scale"],
            spec=self.action_spec,
            distribution_class=TanhNormal,
            distribution_kwargs={"low": self.low, "high": self.high},
        )

    def sample(self, observation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Actions drawn from the actor by reparameterisation, and their log-probabilities."""
        dist = TanhNormal(*self.actor(observation), low=self.low, high=self.high)
        # Each action scored at the Normal value it came from, as CleanRL does. Scoring the
        # action itself (dist.log_prob(action)) inverts the tanh, which for a saturated
        # action gives another value: on HalfCheetah (seed 7) the loss diverged at 15,000
        # frames.
        return dist.rsample_and_log_prob()

    def forward(self, batch: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The sum of the critics', the actor's and the temperature's losses on a sampled
        batch, each transition weighted by its importance weight; and each transition's
        new priority, the critics' larger TD error.

        One backward pass over the sum gives each optimizer its own loss's gradients: the
        actor's loss reads the critics through detached weights, and the temperature's
        loss detaches the log-probabilities.
        """
        observation, action = batch["observation"], batch["action"]
        reward = batch["next", "reward"].squeeze(-1)
        terminated = batch["next", "terminated"].squeeze(-1)
        weight = batch.get("priority_weight", torch.ones_like(reward))
        alpha = self.log_alpha.exp().detach()

        with torch.no_grad():
            next_observation = batch["next", "observation"]
            next_action, next_log_prob = self.sample(next_observation)
            next_q = smaller_q(self.target_critics, next_observation, next_action)
            target_q = reward + self.cfg.gamma * (~terminated) * (next_q - alpha * next_log_prob)
        errors = td_errors(self.critics, observation, action, target_q)
        loss_qvalue = weighted_mean(errors.pow(2).sum(0), weight)

        new_action, log_prob = self.sample(observation)
        q_new = smaller_q([frozen(critic) for critic in self.critics], observation, new_action)
        loss_actor = weighted_mean(alpha * log_prob - q_new, weight)
        loss_alpha = weighted_mean(-self.log_alpha * (log_prob.detach() + self.target_entropy), weight)

        metrics = {
            "loss_actor": loss_actor.detach(),
            "loss_qvalue": loss_qvalue.detach(),
            "alpha": alpha,
            "entropy": -log_prob.detach().mean(),
        }
        return loss_qvalue + loss_actor + loss_alpha, errors.detach().abs().max(0).values, metrics

    def make_optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """Adam for each; ``fused``: one kernel per step instead of several per tensor
        (on one CPU thread, 0.3 ms against 0.76 for these networks' two larger steps)."""
        cfg = self.cfg
        return {
            "actor": torch.optim.Adam(self.actor.parameters(), lr=cfg.lr, fused=True),
            "critics": torch.optim.Adam(self.critics.parameters(), lr=cfg.q_lr, fused=True),
            "alpha": torch.optim.Adam([self.log_alpha], lr=cfg.q_lr, fused=True),
        }

    def after_collect(self, batch: TensorDictBase, frames: int, sum_over_learners: Callable) -> None:
        """Nothing to do: exploration is the actor's own noise."""

    def optimizer_step(self, optimizers: dict[str, torch.optim.Optimizer], update: int) -> None:
        """After backward: every optimizer steps, then the target critics move ``tau`` of
        the way towards the critics (Polyak averaging)."""
        for optimizer in optimizers.values():
            optimizer.step()
        polyak(self.target_critics, self.critics, self.cfg.tau)
