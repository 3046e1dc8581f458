"""TD3 with prioritized replay: twin critics, target policy smoothing and a delayed actor.

Fujimoto et al. (2018). The runtime owns collection, replay, DDP and logging; this file
owns the deterministic actor and its exploration noise, the twin critics, the loss, the
update schedule (the actor and the target networks move every ``policy_delay`` updates)
and the Polyak-averaged targets. Hyperparameters are CleanRL's ``td3_continuous_action.py``
for MuJoCo (``recipe=td3 env.id=Hopper-v5``, with the ``[mujoco]`` extra); the run
defaults are a short Pendulum run that needs no extra.

The loss is written out below, as CleanRL writes it. torchrl's ``TD3Loss`` computes the
same losses and gradients through functional copies of the networks, which costs time on
a CPU: on one thread, 256x256 networks and batch 256, an update took 9.7 ms with it and
6.0 ms written out, with fused Adam; 5.4 ms (sampling included) with the actor's loss left
out where the actor does not learn (docs/benchmarks.md, "Replay recipes against
the single-file scripts").
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule, TensorDictSequential
from torch import nn
from torchrl.envs import EnvBase
from torchrl.modules import MLP, AdditiveGaussianModule, TanhModule

from ._parts import TRANSITION_KEYS, frozen, polyak, smaller_q, td_errors, twin_critics, weighted_mean

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
    """transitions per update, all learners together (learners.batch_size_of)"""
    # One update per frame collected: CleanRL's one gradient step per env step.
    updates_per_batch: int = 64
    """gradient updates per collector batch (frames_per_batch), all learners together"""
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
    """The actor and the twin critics, and a target copy of each (not trained: they follow
    the networks in ``optimizer_step``)."""

    uses_replay = True
    action_spaces = ("continuous",)
    batch_keys = TRANSITION_KEYS

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
        self.critics = twin_critics(observations, actions, hidden)
        self.target_actor = copy.deepcopy(self.actor).requires_grad_(False)
        self.target_critics = copy.deepcopy(self.critics).requires_grad_(False)
        # Whether this update trains the actor, as update_path set it for the update's number.
        self.actor_learns = True
        self.register_buffer("low", action_spec.space.low.clone())
        self.register_buffer("high", action_spec.space.high.clone())

    @property
    def policy(self) -> TensorDictSequential:
        """The collector's policy: the actor's action plus Gaussian noise."""
        return TensorDictSequential(self.actor, self.exploration)

    def forward(self, batch: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The critics' and the actor's losses on a sampled batch, each transition weighted
        by its importance weight; and each transition's new priority, the critics' larger
        TD error.

        The actor learns every ``policy_delay`` updates. On the others its loss is taken
        over no transitions, which costs next to nothing: every parameter still gets a
        gradient (zero), so each learner all-reduces the same tensors at every update, as
        DDP requires, and ``optimizer_step`` leaves the actor's optimizer out. The actor's
        loss reads the critic through detached weights, so the critics learn from their
        own loss only.
        """
        cfg = self.cfg
        observation, action = batch["observation"], batch["action"]
        reward = batch["next", "reward"].squeeze(-1)
        terminated = batch["next", "terminated"].squeeze(-1)
        weight = batch.get("priority_weight", torch.ones_like(reward))

        with torch.no_grad():
            # Target policy smoothing: the target actor's action, plus clipped noise.
            noise = (torch.randn_like(action) * cfg.policy_noise).clamp(-cfg.noise_clip, cfg.noise_clip)
            next_observation = batch["next", "observation"]
            next_action = (self.act(self.target_actor, next_observation) + noise).clamp(self.low, self.high)
            next_q = smaller_q(self.target_critics, next_observation, next_action)
            target_q = reward + cfg.gamma * (~terminated) * next_q
        errors = td_errors(self.critics, observation, action, target_q)
        loss_qvalue = weighted_mean(errors.pow(2).sum(0), weight)

        rows = len(observation) if self.actor_learns else 0
        actor_input = torch.cat([observation[:rows], self.act(self.actor, observation[:rows])], -1)
        q_actor = frozen(self.critics[0])(actor_input).squeeze(-1)
        # weighted_mean, divided by the whole batch's weight: over no rows it is 0, not 0 / 0.
        loss_actor = -(q_actor * weight[:rows]).sum() / weight.sum()
        metrics = {"loss_qvalue": loss_qvalue.detach()}
        if rows:
            metrics["loss_actor"] = loss_actor.detach()
        return loss_actor + loss_qvalue, errors.detach().abs().max(0).values, metrics

    def update_path(self, update: int) -> bool:
        """Whether update ``update`` (from 1) trains the actor, which ``forward`` follows; the
        learner calls this before each update, and with cudagraphs=true records each path
        as its own CUDA graph."""
        self.actor_learns = update % self.cfg.policy_delay == 0
        return self.actor_learns

    def act(self, actor: TensorDictSequential, observation: torch.Tensor) -> torch.Tensor:
        """``actor``'s action for each observation: its network, then its ``TanhModule``'s
        squashing into the action bounds, written out on plain tensors. Calling the
        tensordict modules inside the loss makes ``compile=true`` guard on tensordict's memo
        of classes, which later eager code grows: the loss would compile once more."""
        preactivation = actor[0].module(observation)
        return self.low + (self.high - self.low) * (preactivation.tanh() + 1) / 2

    def make_optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """Adam for each; ``fused``: one kernel per step instead of several per tensor."""
        lr = self.cfg.lr
        return {
            "critics": torch.optim.Adam(self.critics.parameters(), lr=lr, fused=True),
            "actor": torch.optim.Adam(self.actor.parameters(), lr=lr, fused=True),
        }

    def after_collect(self, batch: TensorDictBase, frames: int, sum_over_learners: Callable) -> None:
        """Nothing to do: the exploration noise is constant."""

    def optimizer_step(self, optimizers: dict[str, torch.optim.Optimizer], update: int) -> None:
        """After backward: the critics step at every update; the actor, and the targets
        after it (``tau`` of the way towards the networks, Polyak averaging), every
        ``policy_delay`` updates. A zero gradient would not hold the actor still: Adam's
        momentum would move it anyway."""
        optimizers["critics"].step()
        if update % self.cfg.policy_delay == 0:
            optimizers["actor"].step()
            polyak(self.target_actor, self.actor, self.cfg.tau)
            polyak(self.target_critics, self.critics, self.cfg.tau)
