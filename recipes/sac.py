"""Soft actor-critic with prioritized replay, twin Q networks and a learned temperature.

Haarnoja et al. (2018), the version with automatic entropy tuning. The runtime owns
collection, replay, DDP and logging; this file owns the tanh-Gaussian actor, the twin
critics, the loss and the Polyak-averaged target critics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tensordict import TensorDictBase
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torch import nn
from torchrl.envs import EnvBase
from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator
from torchrl.objectives import SACLoss, SoftUpdate

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
    # and 1e-3 for the critics and the temperature.
    "mujoco": {
        "env": {"num_envs": 4},
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
    """transitions per prioritized sample, per learner and update"""
    # One update per frame this learner collected: the zoo's one gradient step per env step.
    updates_per_batch: int = 64
    """gradient updates per learner after each collector batch"""
    learning_starts: int = 1000
    """frames (all learners) collected before the first update"""
    tau: float = 0.005
    """Polyak averaging rate of the target critics, per update"""
    alpha_init: float = 1.0
    """initial entropy temperature (learned from there)"""


class Agent(nn.Module):
    """The actor, the twin critics and the temperature, plus the policies built from them.

    The runtime wraps this module in DDP, so ``forward`` computes the loss. The temperature
    (``log_alpha``) is a parameter of ``SACLoss``, registered here like the networks: DDP
    all-reduces its gradient too, so it stays the same on every learner.
    """

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
        # The env is a batch of copies; the actor and the loss want one copy's action space
        # (SACLoss's automatic target entropy is minus its size).
        action_spec = env.action_spec_unbatched
        observations = env.observation_spec["observation"].shape[-1]
        actions = action_spec.shape[-1]
        hidden = list(cfg.hidden_sizes)
        self.actor = ProbabilisticActor(
            TensorDictModule(
                nn.Sequential(
                    MLP(
                        in_features=observations,
                        out_features=2 * actions,
                        num_cells=hidden,
                        activation_class=nn.ReLU,
                    ),
                    NormalParamExtractor(),
                ),
                in_keys=["observation"],
                out_keys=["loc", "scale"],
            ),
            in_keys=["loc", "scale"],
            spec=action_spec,
            distribution_class=TanhNormal,
            distribution_kwargs={"low": action_spec.space.low, "high": action_spec.space.high},
        )
        critic = ValueOperator(
            MLP(
                in_features=observations + actions, out_features=1, num_cells=hidden, activation_class=nn.ReLU
            ),
            in_keys=["observation", "action"],
        )
        self.loss_module = SACLoss(
            self.actor,
            critic,
            num_qvalue_nets=2,
            loss_function="l2",
            alpha_init=cfg.alpha_init,
            action_spec=action_spec,
        )
        self.loss_module.make_value_estimator(gamma=cfg.gamma)
        # SACLoss registers its target entropy as a buffer the first time it is read, so a
        # trained agent's state_dict has a key a fresh one lacks: read it now, and
        # checkpoints load into a fresh Agent.
        self.loss_module.target_entropy  # noqa: B018
        self.target_updater = SoftUpdate(self.loss_module, tau=cfg.tau)

    @property
    def policy(self) -> ProbabilisticActor:
        """The collector's policy: samples from the actor (greedy evaluation takes its mode)."""
        return self.actor

    def forward(self, batch: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Loss on a sampled batch, and each transition's new priority: the critics' TD
        error, which SACLoss writes into ``batch``.

        One backward pass over the sum of the three losses gives each optimizer its own
        loss's gradients: SACLoss detaches what each loss must not train (the critics in
        the actor's loss, the log-probabilities in the temperature's).
        """
        losses = self.loss_module(batch)
        loss = losses["loss_actor"] + losses["loss_qvalue"] + losses["loss_alpha"]
        metrics = {key: losses[key].detach() for key in ("loss_actor", "loss_qvalue", "alpha", "entropy")}
        return loss, batch["td_error"], metrics

    def make_optimizers(self) -> dict[str, torch.optim.Optimizer]:
        loss_module, cfg = self.loss_module, self.cfg
        return {
            "actor": torch.optim.Adam(loss_module.actor_network_params.parameters(), lr=cfg.lr),
            "critics": torch.optim.Adam(loss_module.qvalue_network_params.parameters(), lr=cfg.q_lr),
            "alpha": torch.optim.Adam([loss_module.log_alpha], lr=cfg.q_lr),
        }

    def after_collect(self, batch: TensorDictBase, frames: int, sum_over_learners: Callable) -> None:
        """Nothing to do: exploration is the actor's own noise."""

    def optimizer_step(self, optimizers: dict[str, torch.optim.Optimizer], update: int) -> None:
        """After backward: every optimizer steps, then the target critics move towards the
        critics (Polyak averaging)."""
        for optimizer in optimizers.values():
            optimizer.step()
        self.target_updater.step()
