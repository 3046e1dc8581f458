"""PPO with the clipped objective and GAE, on-policy in the DD-PPO style.

Schulman et al. (2017), distributed as in Wijmans et al. (2020): there is no replay rank;
every rank collects with its own environments and trains on what it collected, and DDP
averages the gradients of each minibatch over all ranks. This file owns the networks (an
MLP for vectors; the Nature-DQN convolutions for Atari frames and the MinAtar network for
MinAtar grids, a trunk shared by actor and critic), the policy (categorical for discrete
actions, a Gaussian with a state-independent standard deviation for continuous ones), the
observation and reward normalisation that continuous control wants, the advantage
estimate and the loss.

``algo.recurrent=true`` puts an LSTM between the trunk and the actor's and critic's heads,
as CleanRL's ``ppo_atari_lstm.py`` does: the policy remembers. torchrl's ``LSTMModule``
acts one step at a time; the env's ``InitTracker`` and the module's primer (which
``make_env`` adds for such a policy) carry its state from step to step and from one
collector batch to the next, zeroed at each episode's first step. Each collected step
keeps the state it was acted from; an update runs the LSTM through whole env-copy
sequences from the state at their first step, resetting it where an episode starts.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tensordict import TensorDictBase
from tensordict.nn import AddStateIndependentNormalScale, TensorDictModuleBase
from torch import nn
from torchrl.envs import EnvBase
from torchrl.envs.utils import ExplorationType, exploration_type
from torchrl.modules import MLP, IndependentNormal, LSTMModule, OneHotCategorical, set_recurrent_mode
from torchrl.objectives.value import GAE

from ._parts import image_encoder

NORMALIZED = "observation_normalized"  # the key of the normalised observations
# A recurrent agent's keys: the LSTM's input and output, and its state, which each step
# keeps as the state it was acted from (``("next", ...)``: the state after it).
FEATURES, MEMORY = "features", "memory"
STATE = ("recurrent_state_h", "recurrent_state_c")
IS_INIT = "is_init"  # InitTracker's: True at an episode's first step

RUN_DEFAULTS = {
    "env": {"id": "CartPole-v1", "num_envs": 8},
    "collector": {"frames_per_batch": 256},
    "total_frames": 200_000,
    # The learning rate and the clip range decay over the run's whole budget (the SB3 zoo's
    # lin_0.001 and lin_0.2), whatever total_frames is set to.
    "algo": {"lr_decay_frames": "${total_frames}", "clip_decay_frames": "${total_frames}"},
}

# CleanRL's ppo_atari.py (Schulman et al. 2017's Atari settings): 8 envs x 128 steps, 4
# minibatches, 4 epochs, Adam at 2.5e-4 (eps 1e-5) annealed to 0, clip 0.1, entropy 0.01,
# the value loss clipped and weighted 0.5 x its 0.5 x squared error, GAE 0.95, gamma 0.99,
# gradient norm 0.5, orthogonal initialisation; life loss and clipped rewards for training.
ATARI = {
    "env": {"num_envs": 8, "life_loss": True, "clip_rewards": True},
    "collector": {"frames_per_batch": 1024},
    "total_frames": 10_000_000,
    "algo": {
        "hidden_sizes": [512],
        "lr": 2.5e-4,
        "adam_eps": 1e-5,
        "gamma": 0.99,
        "gae_lambda": 0.95,
        "clip_epsilon": 0.1,
        "clip_decay_frames": None,
        "entropy_coeff": 0.01,
        "critic_coeff": 0.25,
        "critic_loss": "l2",
        "clip_value": True,
        "epochs": 4,
        "minibatch_size": 256,
        "orthogonal_init": True,
        # ppo_atari_lstm.py's LSTM (algo.recurrent=true), between the 512 units and the heads.
        "lstm_hidden_size": 128,
    },
}
FAMILY_DEFAULTS = {
    "atari": ATARI,
    # gymnax-blines' PPO for the MinAtar games (agents/<game>-MinAtar/ppo.yaml): 64 envs x
    # 128 steps, 8 minibatches, 4 epochs, Adam at 5e-4 held, clip 0.2, entropy 0.01, the
    # clipped value loss as above, GAE 0.95, gamma 0.999, gradient norm 0.5; on the MinAtar
    # network (Young & Tian 2019: one 3x3 convolution of 16 channels, 128 units) where
    # gymnax-blines flattens the grid into an MLP; no life loss or reward clipping (MinAtar
    # has neither lives nor large rewards); 5M steps, the MinAtar paper's budget. Against
    # CleanRL's Atari settings above, at 1M frames: Breakout 6.8 to 9.5 where those stayed
    # at 5.5, SpaceInvaders alike, 3 to 4 times the frames/s (docs/benchmarks.md).
    "minatar": {
        "env": {"num_envs": 64},
        "collector": {"frames_per_batch": 8192},
        "total_frames": 5_000_000,
        "algo": {
            **ATARI["algo"],
            "hidden_sizes": [128],
            "lr": 5e-4,
            "lr_decay_frames": None,
            "clip_epsilon": 0.2,
            "gamma": 0.999,
            "minibatch_size": 1024,
        },
    },
    # POPGym: the CartPole settings above, with rewards scaled by the running deviation of
    # the discounted return (CleanRL's MuJoCo scaling, below): POPGym pays each step a
    # fraction of 1 (1/200 on PositionOnlyCartPoleEasy), too little for the critic's loss
    # to move. Recurrent PPO there, seed 1: greedy 0.95 at 20k frames with the scaling, 0.3
    # at 20k and 0.9 at 100k without (docs/benchmarks.md, "Recurrent PPO on POPGym").
    "popgym": {"algo": {"scale_rewards": True}},
    # CleanRL's ppo_continuous_action.py: 1 env x 2048 steps, 32 minibatches, 10 epochs,
    # Adam at 3e-4 (eps 1e-5) annealed to 0, clip 0.2, no entropy bonus, the clipped value
    # loss as above, tanh MLPs of 64 x 64 for the actor and the critic, a state-independent
    # log standard deviation, actions clipped by the environment, observations normalised
    # and clipped to 10, rewards scaled by the running deviation of the discounted return
    # and clipped to 10; 1M steps.
    "mujoco": {
        "env": {"num_envs": 1},
        "collector": {"frames_per_batch": 2048},
        "total_frames": 1_000_000,
        "algo": {
            "hidden_sizes": [64, 64],
            "lr": 3e-4,
            "adam_eps": 1e-5,
            "gamma": 0.99,
            "gae_lambda": 0.95,
            "clip_epsilon": 0.2,
            "clip_decay_frames": None,
            "entropy_coeff": 0.0,
            "critic_coeff": 0.25,
            "critic_loss": "l2",
            "clip_value": True,
            "epochs": 10,
            "minibatch_size": 64,
            "orthogonal_init": True,
            "normalize_observations": True,
            "scale_rewards": True,
        },
    },
}


@dataclass
class Config:
    """PPO hyperparameters: the SB3 zoo's CartPole setting (8 envs x 32 steps per batch, with
    SB3's own defaults: the squared-error value loss weighted 0.5, Adam's epsilon 1e-5,
    orthogonal initialisation); FAMILY_DEFAULTS has CleanRL's for Atari, MinAtar and MuJoCo."""

    hidden_sizes: list[int] = field(default_factory=lambda: [64, 64])
    """units of the hidden layers of the actor and of the critic (for images: of their shared trunk)"""
    lr: float = 1e-3
    """Adam's initial learning rate"""
    adam_eps: float = 1e-5
    """Adam's epsilon"""
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
    clip_decay_frames: int | None = None
    """frames (all learners) over which the clip range falls linearly to 0; null: constant"""
    entropy_coeff: float = 0.0
    """weight of the entropy bonus in the loss"""
    critic_coeff: float = 0.5
    """weight of the value loss in the loss"""
    critic_loss: str = "l2"
    """the value loss's distance: l2 (the squared error) or smooth_l1"""
    clip_value: bool = False
    """clip the value estimate's change to clip_epsilon, as the ratio (CleanRL's clip_vloss)"""
    max_grad_norm: float | None = 0.5
    """the gradients' norm is clipped to this before each step; null: no clipping"""
    epochs: int = 20
    """passes over each collected batch"""
    minibatch_size: int = 256
    """frames per minibatch, per rank"""
    orthogonal_init: bool = True
    """orthogonal weights (gain sqrt 2; 0.01 for the actor's output, 1 for the critic's) and zero biases"""
    normalize_observations: bool = False
    """observations standardised by their running mean and variance over all learners, clipped to 10"""
    scale_rewards: bool = False
    """rewards divided by the running deviation of the discounted return, clipped to 10 (training only)"""
    # The SB3 zoo's PPO-LSTM on CartPole without velocities (hyperparams/ppo_lstm.yml,
    # CartPoleNoVel-v1: 500 of 500 within 100k steps) takes the CartPole settings above and
    # 64 LSTM units; not taken here: its normalised observations, ReLU, default (not
    # orthogonal) initialisation, and a second LSTM for the critic (one serves both here,
    # as in ppo_atari_lstm.py).
    recurrent: bool = False
    """an LSTM between the trunk and the heads (ppo_atari_lstm.py's); minibatches: whole env-copy sequences"""
    lstm_hidden_size: int = 64
    """units of the LSTM (algo.recurrent=true)"""


class Agent(nn.Module):
    """The actor and the critic, the policy built from them, and the PPO loss.

    The runtime wraps this module in DDP, so ``forward`` computes the loss.
    """

    uses_replay = False
    action_spaces = ("discrete", "continuous")

    def __init__(self, cfg: Config, env: EnvBase) -> None:
        super().__init__()
        self.cfg = cfg
        # The learner's loop deals out minibatches of whole env-copy sequences, in time
        # order, to a recurrent agent; of single frames to the others.
        self.recurrent = cfg.recurrent
        action_spec = env.action_spec_unbatched
        observation_shape = env.observation_spec_unbatched["observation"].shape
        self.continuous = action_spec.dtype.is_floating_point
        actions = action_spec.shape[-1]
        # What the networks read: the observation, or its normalised copy, which the policy
        # writes into each collected frame as it acts (so training sees what acting saw).
        self.observation_key = "observation"
        self.normalizer = None
        if cfg.normalize_observations:
            self.normalizer = RunningNorm(observation_shape)
            self.observation_key = NORMALIZED
        # trunk (-> memory) -> actor_head gives the policy's distribution, trunk (-> memory)
        # -> critic_head the value: images share a convolutional trunk, as do vectors under
        # an LSTM; otherwise vectors go to two MLPs of their own.
        images = len(observation_shape) == 3
        if images and self.continuous:
            raise ValueError("ppo: image observations take discrete actions only")
        self.memory = None
        if images or cfg.recurrent:
            self.trunk = (
                image_trunk(observation_shape, cfg) if images else vector_trunk(observation_shape[0], cfg)
            )
            features = cfg.hidden_sizes[-1]
            if cfg.recurrent:
                self.memory = lstm(features, cfg)
                features = cfg.lstm_hidden_size
            self.actor_head, self.critic_head = linear_heads(features, actions, self.continuous, cfg)
        else:
            self.trunk = nn.Identity()
            self.actor_head, self.critic_head = separate_mlps(
                observation_shape[0], actions, self.continuous, cfg
            )
        self.rewards = RewardScale(cfg.gamma) if cfg.scale_rewards else None
        # No value network: after_collect evaluates the critic on each state once and hands
        # GAE the values.
        self.advantage = GAE(gamma=cfg.gamma, lmbda=cfg.gae_lambda, value_network=None, average_gae=False)
        # Frames collected so far, all learners: a buffer, so checkpoints keep it.
        self.register_buffer("frames_seen", torch.zeros((), dtype=torch.long))
        # The clip range in force (after_collect sets it from frames_seen): a tensor, so that
        # a compiled loss reads it as it decays instead of recompiling for each new value.
        self.register_buffer("clip_range", torch.tensor(cfg.clip_epsilon), persistent=False)
        self.lr_schedule: torch.optim.lr_scheduler.LambdaLR | None = None

    def distribution(self, features: torch.Tensor) -> IndependentNormal | OneHotCategorical:
        """The policy's distribution over actions, from the trunk's features."""
        return action_distribution(self.actor_head(features), self.continuous)

    def value(self, observation: torch.Tensor) -> torch.Tensor:
        """The critic's estimate of each observation's value, shape ``[..., 1]`` (a
        feed-forward agent's: a recurrent one's value needs the state, ``step_features``)."""
        return self.critic_head(self.trunk(observation))

    def step_features(self, steps: TensorDictBase) -> torch.Tensor:
        """What the heads read for each of ``steps`` (any shape), taken one at a time: the
        trunk's features, through the LSTM from each step's recorded state for a recurrent
        agent (as the policy acted)."""
        features = self.trunk(steps[self.observation_key])
        if self.memory is None:
            return features
        return remember(self.memory, steps, features)[MEMORY]

    def sequence_features(self, batch: TensorDictBase) -> torch.Tensor:
        """What the heads read for each step of a ``[copies, steps]`` batch: a recurrent
        agent runs its LSTM through each copy's steps in time order, from the state
        recorded at the first and from zeros where an episode starts (``is_init``), with
        the weights as they are now."""
        features = self.trunk(batch[self.observation_key])
        if self.memory is None:
            return features
        sequences = batch.select(*STATE, IS_INIT).set(FEATURES, features)
        with set_recurrent_mode(True):
            return self.memory(sequences)[MEMORY]

    @property
    def policy(self) -> Policy:
        """The collector's policy, on the same networks as the loss."""
        return Policy(self)

    def forward(self, batch: TensorDictBase) -> tuple[torch.Tensor, None, dict[str, torch.Tensor]]:
        """The clipped surrogate objective, the value loss and the entropy bonus on a
        minibatch that ``after_collect`` gave advantages to (no priorities: nothing is
        replayed): frames, or for a recurrent agent whole sequences ``[copies, steps]``.
        The trunk runs once for the actor's head and the critic's."""
        cfg = self.cfg
        features = self.sequence_features(batch)
        if self.memory is not None:  # the loss weighs every frame alike, whichever sequence holds it
            batch, features = batch.reshape(-1), features.flatten(0, 1)
        distribution = self.distribution(features)
        ratio = (distribution.log_prob(batch["action"]) - batch["action_log_prob"]).exp()
        advantage = batch["advantage"].squeeze(-1)
        if len(advantage) > 1:  # a straggler's minibatch may hold a single frame
            advantage = (advantage - advantage.mean()) / advantage.std().clamp_min(1e-6)
        low, high = 1 - self.clip_range, 1 + self.clip_range
        loss_objective = -torch.min(ratio * advantage, ratio.clamp(low, high) * advantage).mean()

        value, old_value, target = self.critic_head(features), batch["state_value"], batch["value_target"]
        error = self.value_distance(value, target)
        if cfg.clip_value:  # the value may move no further than the ratio from the collected one
            clipped = old_value + (value - old_value).clamp(-self.clip_range, self.clip_range)
            error = torch.max(error, self.value_distance(clipped, target))
        loss_critic = cfg.critic_coeff * error.mean()

        entropy = distribution.entropy().mean()
        loss = loss_objective + loss_critic - cfg.entropy_coeff * entropy
        metrics = {
            "loss_objective": loss_objective.detach(),
            "loss_critic": loss_critic.detach(),
            "entropy": entropy.detach(),
        }
        return loss, None, metrics

    def value_distance(self, value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Each frame's value loss: the squared error (``l2``) or the smooth L1 distance."""
        if self.cfg.critic_loss == "smooth_l1":
            return nn.functional.smooth_l1_loss(value, target, reduction="none")
        return (value - target).square()

    def make_optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """Adam with the learning-rate schedule; ``fused``: one kernel per step instead of
        several per tensor (0.12 against 0.33 ms per step for CleanRL's MuJoCo networks)."""
        cfg = self.cfg
        adam = torch.optim.Adam(self.parameters(), lr=cfg.lr, eps=cfg.adam_eps, fused=True)
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
    def after_collect(
        self, batch: TensorDictBase, frames: int, sum_over_learners: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """Advantages and value targets for the batch just collected, with the critic and
        the normalisation as they were when it was collected (GAE runs along the batch's
        last, time dimension); then the normalisation statistics take in this batch (all
        learners' batches, through ``sum_over_learners``), and the learning rate and the
        clip range are set for the updates on it."""
        if self.normalizer is not None:
            batch["next", self.observation_key] = self.normalizer(batch["next", "observation"])
        if self.rewards is not None:
            self.rewards.scale(batch, sum_over_learners)
        self.write_values(batch)
        self.advantage(batch)
        if self.normalizer is not None:
            self.normalizer.update(batch["observation"], sum_over_learners)
        # A batch trains at the rate and clip range of the frames collected before it
        # (CleanRL's schedule): the first one at the initial values, and each step of the
        # scheduler comes after the optimizer's steps on the batch before.
        if self.lr_schedule is not None and self.frames_seen > 0:
            with warnings.catch_warnings():
                # torch warns when a resumed run's scheduler steps before its fresh optimizer
                # has: that would skip a value of a schedule by step count, not of this one.
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
                self.lr_schedule.step()
        if self.cfg.clip_decay_frames:
            remaining = max(0.0, 1.0 - self.frames_seen.item() / self.cfg.clip_decay_frames)
            self.clip_range.fill_(self.cfg.clip_epsilon * remaining)
        self.frames_seen += frames

    def write_values(self, batch: TensorDictBase) -> None:
        """The critic's value of each step's state and of its next state, evaluating every
        state once (on images the trunk is most of a step's cost): a step's next state is the
        following step's state, except where the episode ended (the following step starts a
        new one) and at the rollout's last step, whose next states are evaluated apart. A
        recurrent agent evaluates each state from the LSTM state recorded with it, the
        next states from the state after the step."""
        keys = [self.observation_key, *(STATE if self.memory is not None else ())]
        states, next_states = batch.select(*keys), batch["next"].select(*keys)
        if self.memory is not None:
            states[IS_INIT] = batch[IS_INIT]
            next_states[IS_INIT] = torch.zeros_like(batch[IS_INIT])  # the episode goes on into them
        apart = batch["next", "done"].squeeze(-1).clone()
        apart[:, -1] = True
        values = self.critic_head(self.step_features(torch.cat([states.flatten(0, 1), next_states[apart]])))
        value = values[: batch.numel()].unflatten(0, batch.shape)
        next_value = torch.cat([value[:, 1:], torch.empty_like(value[:, :1])], dim=1)
        next_value[apart] = values[batch.numel() :]
        batch["state_value"], batch["next", "state_value"] = value, next_value

    def optimizer_step(self, optimizers: dict[str, torch.optim.Optimizer], update: int) -> None:
        """After backward: the gradients' norm clipped (DDP has averaged them already, so
        every learner clips alike), then Adam steps. PPO has no target network."""
        if self.cfg.max_grad_norm is not None:
            nn.utils.clip_grad_norm_(self.parameters(), self.cfg.max_grad_norm)
        optimizers["adam"].step()


class Policy(TensorDictModuleBase):
    """Acts with the agent's networks: reads ``observation`` and writes the action sampled
    from the policy's distribution (in deterministic mode, greedy evaluation's: its mean,
    or its likeliest action) and the action's log-probability; with normalised
    observations, also the normalised observation it acted on, so that training sees what
    acting saw.

    Written out rather than built from torchrl's ``ProbabilisticActor`` (behind a
    ``TensorDictSequential`` for the normalisation), which does the same: on one Hopper
    that took 0.26 ms a step against 0.17 here (one thread, this project's 2-core
    machine), and with CleanRL's one env per learner the collector calls the policy at
    every frame (docs/benchmarks.md, "PPO against CleanRL's scripts")."""

    def __init__(self, agent: Agent) -> None:
        super().__init__()
        self.normalizer, self.trunk, self.actor_head = agent.normalizer, agent.trunk, agent.actor_head
        self.memory = agent.memory
        self.continuous = agent.continuous
        self.in_keys = ["observation"]
        self.out_keys = ["action", "action_log_prob"]
        if self.normalizer is not None:
            self.out_keys.append(NORMALIZED)
        if self.memory is not None:
            self.in_keys += [*STATE, IS_INIT]
            self.out_keys += [("next", key) for key in STATE]

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        observation = tensordict["observation"]
        if self.normalizer is not None:
            observation = tensordict[NORMALIZED] = self.normalizer(observation)
        features = self.trunk(observation)
        if self.memory is not None:  # one step of the LSTM; the state after it goes with the step
            remembered = remember(self.memory, tensordict, features)
            features = remembered[MEMORY]
            for key in STATE:
                tensordict["next", key] = remembered["next", key]
        distribution = action_distribution(self.actor_head(features), self.continuous)
        if exploration_type() is ExplorationType.DETERMINISTIC:
            action = distribution.deterministic_sample
        else:
            action = distribution.sample()
        tensordict["action"] = action
        tensordict["action_log_prob"] = distribution.log_prob(action)
        return tensordict


def action_distribution(output, continuous: bool) -> IndependentNormal | OneHotCategorical:
    """The distribution over actions of the actor head's output: a Gaussian's mean and
    standard deviation, or categorical logits."""
    if continuous:
        loc, scale = output
        return IndependentNormal(loc, scale)
    return OneHotCategorical(logits=output)


def separate_mlps(observations, actions, continuous, cfg):
    """The actor's and the critic's MLPs (tanh, as CleanRL's): categorical logits for
    discrete actions, or a Gaussian's mean with a learned state-independent log standard
    deviation (starting at 0) for continuous ones, sampled unbounded: the env clips the
    action it gets, and training keeps the sampled one, whose log-probability it is."""
    hidden = list(cfg.hidden_sizes)
    actor = MLP(in_features=observations, out_features=actions, num_cells=hidden)
    critic = MLP(in_features=observations, out_features=1, num_cells=hidden)
    if cfg.orthogonal_init:
        orthogonal_init(actor, output_gain=0.01)
        orthogonal_init(critic, output_gain=1.0)
    if continuous:
        actor = nn.Sequential(actor, AddStateIndependentNormalScale(actions, scale_lb=1e-8))
    return actor, critic


def image_trunk(observation_shape, cfg):
    """A convolutional trunk for the actor and the critic to share, on uint8 images: the
    Nature-DQN convolutions for Atari's frames or the MinAtar network's one for MinAtar's
    grids (``image_encoder``), then ``hidden_sizes`` units."""
    encoder, features = image_encoder(observation_shape)
    dense = MLP(
        features,
        cfg.hidden_sizes[-1],
        num_cells=list(cfg.hidden_sizes[:-1]),
        activation_class=nn.ReLU,
        activate_last_layer=True,
    )
    trunk = nn.Sequential(*encoder, dense)
    if cfg.orthogonal_init:
        orthogonal_init(trunk, output_gain=math.sqrt(2))
    return trunk


def vector_trunk(observations, cfg):
    """An MLP trunk (tanh, as CleanRL's) for the actor and the critic to share, on vectors:
    what a recurrent agent's LSTM reads."""
    trunk = MLP(
        observations, cfg.hidden_sizes[-1], num_cells=list(cfg.hidden_sizes[:-1]), activate_last_layer=True
    )
    if cfg.orthogonal_init:
        orthogonal_init(trunk, output_gain=math.sqrt(2))
    return trunk


def linear_heads(features, actions, continuous, cfg):
    """The actor's and the critic's linear heads on a shared trunk's ``features``."""
    actor_head, critic_head = nn.Linear(features, actions), nn.Linear(features, 1)
    if cfg.orthogonal_init:
        orthogonal_init(actor_head, output_gain=0.01)
        orthogonal_init(critic_head, output_gain=1.0)
    if continuous:
        actor_head = nn.Sequential(actor_head, AddStateIndependentNormalScale(actions, scale_lb=1e-8))
    return actor_head, critic_head


def lstm(features, cfg):
    """torchrl's LSTMModule on the trunk's ``features``, one layer of ``lstm_hidden_size``
    (orthogonal weights and zero biases, as ppo_atari_lstm.py initialises them)."""
    module = LSTMModule(
        input_size=features, hidden_size=cfg.lstm_hidden_size, in_key=FEATURES, out_key=MEMORY
    )
    if cfg.orthogonal_init:
        for name, weight in module.named_parameters():
            if "weight" in name:
                nn.init.orthogonal_(weight, 1.0)
            else:
                nn.init.zeros_(weight)
    return module


def remember(memory, steps, features):
    """One step of ``memory`` for each of ``steps`` (any shape), from the state recorded
    with it (zeros at an episode's first step: ``is_init``): a tensordict with the
    LSTM's output (``MEMORY``) and the state after the step (``("next", key)``)."""
    return memory(steps.select(*STATE, IS_INIT).set(FEATURES, features))


def orthogonal_init(network: nn.Module, output_gain: float) -> None:
    """CleanRL's ``layer_init``: every linear and convolutional layer orthogonal with gain
    sqrt(2) and zero bias, its last layer with ``output_gain``."""
    layers = [module for module in network.modules() if isinstance(module, (nn.Linear, nn.Conv2d))]
    for layer in layers:
        nn.init.orthogonal_(layer.weight, math.sqrt(2) if layer is not layers[-1] else output_gain)
        nn.init.zeros_(layer.bias)


class RunningMoments(nn.Module):
    """The running mean and variance of values seen in batches (Chan et al.'s parallel
    update, as gymnasium's ``RunningMeanStd``), every batch of every learner counted: each
    update sums its batch's count, sum and sum of squares over the learners first, so the
    statistics are the same on every learner. Buffers: checkpoints and the final agent
    keep them."""

    def __init__(self, shape: torch.Size | tuple[int, ...] = ()) -> None:
        super().__init__()
        self.register_buffer("count", torch.tensor(1e-4, dtype=torch.float64))  # gymnasium's start
        self.register_buffer("mean", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(shape, dtype=torch.float64))

    def update(self, values: torch.Tensor, sum_over_learners: Callable[[torch.Tensor], torch.Tensor]) -> None:
        values = values.reshape(-1, *self.mean.shape).double()
        local = torch.cat(
            [values.new_tensor([len(values)]), values.sum(0).flatten(), values.square().sum(0).flatten()]
        )
        total = sum_over_learners(local.to(self.mean.device))
        count, sums, squares = total[0], *total[1:].view(2, *self.mean.shape)
        batch_mean = sums / count
        batch_var = (squares / count - batch_mean.square()).clamp(min=0)
        delta, combined = batch_mean - self.mean, self.count + count
        self.mean += delta * count / combined
        self.var.copy_(
            (self.var * self.count + batch_var * count + delta.square() * self.count * count / combined)
            / combined
        )
        self.count.copy_(combined)


class RunningNorm(RunningMoments):
    """Observations standardised by the running moments and clipped to +-10 (CleanRL's
    ``NormalizeObservation`` and its clip)."""

    CLIP = 10.0

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        scaled = (observation - self.mean) / torch.sqrt(self.var + 1e-8)
        return scaled.clamp(-self.CLIP, self.CLIP).to(observation.dtype)


class RewardScale(nn.Module):
    """Training rewards divided by the running deviation of each env copy's discounted
    return and clipped to +-10: CleanRL's ``NormalizeReward`` (gymnasium's) and its clip.
    The copies' returns so far carry from one batch to the next (not saved: a resumed run
    starts new episodes); the deviation's moments are the learners' and a buffer."""

    CLIP = 10.0

    def __init__(self, gamma: float) -> None:
        super().__init__()
        self.gamma = gamma
        self.moments = RunningMoments()
        self.returns: torch.Tensor | None = None  # each env copy's discounted return so far

    def scale(self, batch: TensorDictBase, sum_over_learners: Callable[[torch.Tensor], torch.Tensor]) -> None:
        reward, terminated = batch["next", "reward"], batch["next", "terminated"]
        running = torch.zeros_like(reward[:, 0]) if self.returns is None else self.returns
        returns = []
        # [env copies, steps]: time runs along dim 1. A step's discount is 0 where its
        # episode ended. Slicing all steps at once (unbind) and stacking at the end took 11 ms
        # for 2,048 steps of one Hopper, against 27 indexing and writing one step at a time.
        discount = self.gamma * (~terminated)
        for step_reward, step_discount in zip(reward.unbind(1), discount.unbind(1), strict=True):
            running = running * step_discount + step_reward
            returns.append(running)
        self.returns = running
        self.moments.update(torch.stack(returns, 1), sum_over_learners)
        deviation = torch.sqrt(self.moments.var + 1e-8).to(reward.dtype)
        batch["next", "reward"] = (reward / deviation).clamp(-self.CLIP, self.CLIP)
