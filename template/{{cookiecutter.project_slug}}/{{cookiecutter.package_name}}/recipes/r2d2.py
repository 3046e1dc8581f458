"""R2D2: an LSTM Q-network trained on sequences from prioritized replay.

Kapturowski et al. (2019), "Recurrent experience replay in distributed reinforcement
learning". The runtime owns collection, the replay shards, DDP and logging; this file owns
what is specific to R2D2: the Q network (an MLP, or for images the encoder of
``_parts.image_encoder``, then an LSTM and a linear head), epsilon-greedy exploration, how
each env copy's stream is cut into overlapping sequences, the loss and the target network.

The collector acts one step at a time with torchrl's ``LSTMModule``; the env's
``InitTracker`` and the module's primer (which ``make_env`` adds for this policy) carry
the state from step to step and from one collector batch to the next, zeroed at each
episode's first step, and every step keeps the state it was acted from. ``replay_items``
cuts each copy's steps into sequences of ``sequence_length`` steps, each starting
``sequence_length - overlap`` steps after the one before, across collector batches: the
steps after the last sequence start wait for the next batch, so no step is lost or
repeated beyond the overlap. A sequence is one replay item, with the state its first step
was acted from: it lives whole in one shard, is drawn by one priority and gets one back.
Pixel observations are stored once per step (replay/frames.py): the steps a sequence shares
with the one before are stored with that one.

An update runs the LSTM from that state over the first ``burn_in`` steps without
gradients (the paper's burn-in, which rebuilds a state the current weights would have
had), then over the rest with gradients, resetting it where an episode starts inside the
sequence. The targets are n-step double-Q targets under the paper's value rescaling
``h``; a sequence's priority mixes its TD errors as the paper does, 0.9 of their maximum
and 0.1 of their mean. On Atari the head is the paper's dueling head (``algo.dueling``).
Left out from the paper: the per-actor epsilons of Ape-X (one annealed epsilon here, as
DQN's).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase, TensorDictSequential
from torch import nn
from torchrl.envs import EnvBase
from torchrl.modules import MLP, EGreedyModule, LSTMModule, set_recurrent_mode

from ._parts import image_encoder, weighted_mean

# The LSTM's input and output, and its state, which each collected step keeps as the state
# it was acted from (``("next", ...)``: the state after it); a replay item keeps its first
# step's only.
FEATURES, MEMORY = "features", "memory"
STATE = ("recurrent_state_h", "recurrent_state_c")
IS_INIT = "is_init"  # InitTracker's: True at an episode's first step
ACTION_VALUE = "action_value"  # the Q values the collector acted on
# The paper's value rescaling h(x) = sign(x) (sqrt(|x| + 1) - 1) + eps x, and its mix of a
# sequence's absolute TD errors into its priority.
RESCALING_EPS = 1e-3
PRIORITY_ETA = 0.9

# POPGym's CartPole without velocities (returns normalised to at most 1): memory is what
# it takes. Sequences, burn-in and n-step are the paper's proportions scaled to episodes of
# up to 200 steps (sequences of 20 overlapping by half, as the paper's 80 by 40; a quarter
# of the sequence for burn-in; n 3 as Ape-X's on small problems); the paper's priority
# exponent (alpha 0.9; its beta, 0.6, is replay.beta=0.6); a DQN-sized Adam, epsilon and
# target period on CartPole.
RUN_DEFAULTS = {
    "env": {"id": "popgym-PositionOnlyCartPoleEasy-v0", "num_envs": 16},
    "collector": {"frames_per_batch": 320},
    "replay": {"alpha": 0.9},
    "total_frames": 100_000,
}
FAMILY_DEFAULTS = {
    # POPGym normalises an episode's return to at most 1, spread over its steps (1/200 a
    # step on PositionOnlyCartPoleEasy): Q values that differ by thousandths between actions.
    # Scaled by 100 for training, a step there pays 0.5. Unscaled (and with 4 updates per
    # collector batch), seed 1 stayed near 0.1 (docs/benchmarks.md, "R2D2 on POPGym").
    "popgym": {"algo": {"reward_scale": 100.0}},
    # The paper's Atari settings (Kapturowski et al. 2019, section 2): sequences of 80 steps
    # overlapping by 40, a burn-in of 40, 5-step double-Q targets, discount 0.997, 64
    # sequences an update, the target copied every 2,500 updates, no life-loss terminal and
    # no reward clipping (the value rescaling h takes the rewards' scale). DQN's Nature CNN
    # and 512 units under an LSTM of 512, then the paper's dueling head (a value and an
    # advantage stream of 512 units each); DQN's Adam rate and epsilon schedule. Single frames
    # (env.frame_stack=1, as ppo_atari_lstm.py): the LSTM remembers, and replay stores each
    # frame once, 0.28 MB a sequence of 80 steps overlapping by 40 (1.1 MB stacked by 4).
    # 20,000 sequences (5.6 GB) where the paper keeps 100,000 (28 GB here). The paper's
    # learner replays about 0.4 steps per step collected (5 updates of 64 x 80 steps a
    # second, 256 actors of 260 steps a second); one update per 1,280 frames is the fewest a
    # collector batch can have, 4 replayed steps per step.
    "atari": {
        "env": {"num_envs": 8, "frame_stack": 1},
        "collector": {"frames_per_batch": 1280},
        "replay": {"capacity": 20_000},
        "total_frames": 10_000_000,
        "algo": {
            "hidden_sizes": [512],
            "lstm_hidden_size": 512,
            "dueling": True,
            "lr": 1e-4,
            "gamma": 0.997,
            "batch_size": 64,
            "updates_per_batch": 1,
            "learning_starts": 80_000,
            "sequence_length": 80,
            "overlap": 40,
            "burn_in": 40,
            "n_steps": 5,
            "eps_end": 0.01,
            "eps_frames": 1_000_000,
            "target_update_period": 2500,
        },
    },
}


@dataclass
class Config:
    """R2D2 hyperparameters. Frame counts are summed over all learner ranks; batches count
    sequences."""

    hidden_sizes: list[int] = field(default_factory=lambda: [64])
    """units of the layers before the LSTM (after the convolutions, for images)"""
    lstm_hidden_size: int = 64
    """units of the LSTM"""
    dueling: bool = False
    """a dueling head (Wang et al. 2016): Q = V + A - mean(A), from a value and an advantage
    stream of lstm_hidden_size units each; false: one linear layer"""
    lr: float = 1e-3
    """Adam's learning rate"""
    gamma: float = 0.99
    """discount factor"""
    batch_size: int = 32
    """sequences per update, all learners together (learners.batch_size_of)"""
    # 16 updates of 32 sequences per 320 frames train each step 24 times on average (15 of
    # a sequence's 20 steps after the burn-in), about DQN's 32 here. With 8, POPGym's
    # CartPole evaluated 0.42 at 60,000 frames; with 16, 1.0 at 30,000 (docs/benchmarks.md,
    # "R2D2 on POPGym").
    updates_per_batch: int = 16
    """gradient updates per collector batch (frames_per_batch), all learners together"""
    learning_starts: int = 2000
    """frames (all learners) collected before the first update"""
    sequence_length: int = 20
    """steps per replayed sequence"""
    overlap: int = 10
    """steps a sequence shares with the next one of the same env copy"""
    burn_in: int = 5
    """first steps of a sequence that only rebuild the LSTM's state (no loss, no gradient)"""
    n_steps: int = 3
    """rewards summed before bootstrapping from the target network"""
    eps_init: float = 1.0
    """exploration: the probability of a random action at the start"""
    eps_end: float = 0.05
    """exploration: the probability of a random action after eps_frames"""
    eps_frames: int = 20_000
    """frames (all learners) over which epsilon falls linearly from eps_init to eps_end"""
    target_update_period: int = 100
    """updates between copies of the Q network into the target network"""
    max_grad_norm: float | None = 10.0
    """the gradients' norm is clipped to this before each step; null: no clipping"""
    reward_scale: float = 1.0
    """training rewards are multiplied by this (evaluation reports the env's own)"""


class DuelingHead(nn.Module):
    """Q values as a state's value plus each action's advantage over their mean (Wang et al.
    2016). torchrl's dueling networks bring a feature trunk of their own; here the LSTM is
    the trunk."""

    def __init__(self, features: int, actions: int) -> None:
        super().__init__()
        self.value = MLP(features, 1, num_cells=[features], activation_class=nn.ReLU)
        self.advantage = MLP(features, actions, num_cells=[features], activation_class=nn.ReLU)

    def forward(self, memory: torch.Tensor) -> torch.Tensor:
        advantage = self.advantage(memory)
        return self.value(memory) + advantage - advantage.mean(-1, keepdim=True)


class QNetwork(nn.Module):
    """trunk -> LSTM -> head (linear, or dueling): Q values of every action, from an
    observation and the LSTM's state."""

    def __init__(self, observation_shape: torch.Size, actions: int, cfg: Config) -> None:
        super().__init__()
        hidden = list(cfg.hidden_sizes)
        # Images go through the convolutions first (uint8 to floats inside the network).
        encoder, features = (
            image_encoder(observation_shape) if len(observation_shape) == 3 else ((), observation_shape[0])
        )
        dense = MLP(
            features, hidden[-1], num_cells=hidden[:-1], activation_class=nn.ReLU, activate_last_layer=True
        )
        self.trunk = nn.Sequential(*encoder, dense)
        self.memory = LSTMModule(
            input_size=hidden[-1], hidden_size=cfg.lstm_hidden_size, in_key=FEATURES, out_key=MEMORY
        )
        size = cfg.lstm_hidden_size
        self.head = DuelingHead(size, actions) if cfg.dueling else nn.Linear(size, actions)

    def step(self, steps: TensorDictBase) -> TensorDictBase:
        """One LSTM step for each of ``steps`` (any shape), from the state recorded with it:
        a tensordict with the Q values (``ACTION_VALUE``) and the state after the step
        (``("next", key)``)."""
        inputs = steps.select(*STATE, IS_INIT).set(FEATURES, self.trunk(steps["observation"]))
        remembered = self.memory(inputs)
        remembered[ACTION_VALUE] = self.head(remembered[MEMORY])
        return remembered

    def sequences(
        self, observation: torch.Tensor, is_init: torch.Tensor, state: tuple, burn_in: int
    ) -> torch.Tensor:
        """Q values ``[sequences, steps - burn_in, actions]`` of ``[sequences, steps]``
        observations, the LSTM starting from ``state`` (each sequence's first step's) and
        restarting from zeros where ``is_init`` marks an episode's first step. The first
        ``burn_in`` steps only move the state on, without gradients."""
        with torch.no_grad():
            start = self._run(observation[:, :burn_in], is_init[:, :burn_in], state) if burn_in else state
        features = self._features(observation[:, burn_in:])
        memory = self._lstm(features, is_init[:, burn_in:], start)
        return self.head(memory[MEMORY])

    def _run(self, observation: torch.Tensor, is_init: torch.Tensor, state: tuple) -> tuple:
        """The LSTM's state after the last of ``observation``'s steps."""
        memory = self._lstm(self._features(observation), is_init, state)
        return tuple(memory["next", key][:, -1] for key in STATE)

    def _features(self, observation: torch.Tensor) -> torch.Tensor:
        return self.trunk(observation.flatten(0, 1)).unflatten(0, observation.shape[:2])

    def _lstm(self, features: torch.Tensor, is_init: torch.Tensor, state: tuple) -> TensorDictBase:
        """The LSTM over ``[sequences, steps]`` in torchrl's recurrent mode, which takes the
        state at the first step and at each ``is_init`` step (where it must be zeros)."""
        sequences, steps = features.shape[:2]
        first = is_init[:, 0].view(-1, 1, 1)
        inputs = TensorDict({FEATURES: features, IS_INIT: is_init}, batch_size=[sequences, steps])
        for key, value in zip(STATE, state, strict=True):
            states = value.new_zeros(sequences, steps, *value.shape[1:])
            states[:, 0] = value.masked_fill(first, 0.0)
            inputs[key] = states
        with set_recurrent_mode(True):
            return self.memory(inputs)


class Actor(TensorDictModuleBase):
    """The Q network's greedy action, one LSTM step per env step: reads the observation
    and the state it is acted from, writes the one-hot action, its Q values and the state
    after the step."""

    def __init__(self, network: QNetwork) -> None:
        super().__init__()
        self.network = network
        self.in_keys = ["observation", *STATE, IS_INIT]
        self.out_keys = ["action", ACTION_VALUE, *(("next", key) for key in STATE)]

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        remembered = self.network.step(tensordict)
        q = remembered[ACTION_VALUE]
        tensordict[ACTION_VALUE] = q
        tensordict["action"] = F.one_hot(q.argmax(-1), q.shape[-1])
        for key in STATE:
            tensordict["next", key] = remembered["next", key]
        return tensordict


class Agent(nn.Module):
    """Everything R2D2 learns, the policy built from it, and the cutting of collected steps
    into replayed sequences.

    The runtime wraps this module in DDP, so ``forward`` computes the loss.
    """

    uses_replay = True
    action_spaces = ("discrete",)
    # What each collected step gives a sequence: ``replay_items`` keeps the state of a
    # sequence's first step only.
    batch_keys = (
        "observation",
        "action",
        IS_INIT,
        *STATE,
        ("next", "reward"),
        ("next", "terminated"),
        ("next", "done"),
    )

    def __init__(self, cfg: Config, env: EnvBase) -> None:
        super().__init__()
        for name in ("overlap", "burn_in"):
            if not 0 <= getattr(cfg, name) < cfg.sequence_length:
                value = getattr(cfg, name)
                raise ValueError(f"r2d2: algo.{name} must be in [0, algo.sequence_length), got {value}")
        if cfg.n_steps < 1:
            raise ValueError(f"r2d2: algo.n_steps must be >= 1, got {cfg.n_steps}")
        self.cfg = cfg
        # Replay items are sequences of this many steps (recipes.first_batch collects as
        # many), each sharing this many with the one before (replay stores those once).
        self.sequence_length = cfg.sequence_length
        self.sequence_overlap = cfg.overlap
        self.action_spec = env.action_spec
        observation_shape = env.observation_spec_unbatched["observation"].shape
        self.q_network = QNetwork(observation_shape, self.action_spec.shape[-1], cfg)
        # Not trained: a copy of the Q network, refreshed every target_update_period updates.
        self.target_network = copy.deepcopy(self.q_network).requires_grad_(False)
        self.exploration = EGreedyModule(
            self.action_spec, eps_init=cfg.eps_init, eps_end=cfg.eps_end, annealing_num_steps=cfg.eps_frames
        )
        # Each env copy's steps collected after its last sequence's start, waiting for the
        # next batch ([copies, steps]). Not saved: a resumed run starts new episodes.
        self.pending: TensorDictBase | None = None

    @property
    def policy(self) -> TensorDictSequential:
        """The collector's policy: the Q network's greedy action, random with probability
        epsilon (greedy evaluation leaves the exploration out)."""
        return TensorDictSequential(Actor(self.q_network), self.exploration)

    def replay_items(self, batch: TensorDictBase) -> TensorDictBase:
        """The sequences that this collector batch ``[copies, steps]`` completes, one
        replay item each (``[copies, sequences]``, each copy's in order, the steps along
        each entry's third dimension): every ``sequence_length - overlap`` steps of a
        copy's stream a sequence starts."""
        cfg = self.cfg
        steps = batch.select(*self.batch_keys)
        if self.pending is not None:
            steps = torch.cat([self.pending, steps], 1)
        stride = cfg.sequence_length - cfg.overlap
        starts = range(0, steps.shape[1] - cfg.sequence_length + 1, stride)
        self.pending = steps[:, len(starts) * stride :].clone()
        if not starts:  # no sequence complete yet: replay takes an empty batch as nothing
            return TensorDict(batch_size=[0])
        cut = torch.stack([steps[:, start : start + cfg.sequence_length] for start in starts], 1)
        items = cut.exclude(*STATE)
        items.batch_size = cut.shape[:2]
        for key in STATE:
            items[key] = cut[key][:, :, 0]
        return items

    def forward(self, batch: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The squared error of the Q values of the actions taken after the burn-in
        against their rescaled n-step double-Q targets, averaged over each sequence's steps
        that have a target and weighted by each sequence's importance weight; and each
        sequence's new priority."""
        cfg = self.cfg
        observation, is_init = batch["observation"], batch[IS_INIT]
        state = tuple(batch[key] for key in STATE)
        q = self.q_network.sequences(observation, is_init, state, cfg.burn_in)
        with torch.no_grad():  # no gradients at all: one pass, burn-in included
            target_q = self.target_network.sequences(observation, is_init, state, 0)[:, cfg.burn_in :]
            # Double Q: the online network picks the action the target network values.
            greedy = q.argmax(-1, keepdim=True)
            bootstrap = rescale_inverse(target_q.gather(-1, greedy).squeeze(-1))
            train = slice(cfg.burn_in, None)
            returns, targets_valid = n_step_targets(
                batch["next", "reward"][:, train].squeeze(-1) * cfg.reward_scale,
                batch["next", "done"][:, train].squeeze(-1),
                batch["next", "terminated"][:, train].squeeze(-1),
                bootstrap,
                cfg.gamma,
                cfg.n_steps,
            )
            target = rescale(returns)
        taken = (q * batch["action"][:, train]).sum(-1)
        valid = targets_valid.to(q.dtype)
        error = (taken - target) * valid
        steps = valid.sum(-1).clamp(min=1)
        weight = batch.get("priority_weight", torch.ones_like(steps))
        loss = weighted_mean(0.5 * error.pow(2).sum(-1) / steps, weight)
        absolute = error.detach().abs()
        priority = PRIORITY_ETA * absolute.max(-1).values + (1 - PRIORITY_ETA) * absolute.sum(-1) / steps
        metrics = {"loss": loss.detach(), "epsilon": self.exploration.eps.detach()}
        return loss, priority, metrics

    def make_optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"adam": torch.optim.Adam(self.q_network.parameters(), lr=self.cfg.lr)}

    def after_collect(self, batch: TensorDictBase, frames: int, sum_over_learners: Callable) -> None:
        """Anneal epsilon by the frames all learners collected in this step (a buffer of
        the exploration module: checkpoints keep it)."""
        cfg = self.cfg
        decay = frames * (cfg.eps_init - cfg.eps_end) / cfg.eps_frames
        eps = self.exploration.eps
        eps.copy_((eps - decay).clamp(min=cfg.eps_end))

    def optimizer_step(self, optimizers: dict[str, torch.optim.Optimizer], update: int) -> None:
        """After backward: the gradients' norm clipped (DDP has averaged them already),
        Adam steps, and every ``target_update_period`` updates the Q network is copied into
        the target."""
        if self.cfg.max_grad_norm is not None:
            nn.utils.clip_grad_norm_(self.q_network.parameters(), self.cfg.max_grad_norm)
        optimizers["adam"].step()
        if update % self.cfg.target_update_period == 0:
            self.target_network.load_state_dict(self.q_network.state_dict())


def n_step_targets(
    reward: torch.Tensor,
    done: torch.Tensor,
    terminated: torch.Tensor,
    bootstrap: torch.Tensor,
    gamma: float,
    n: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each step ``t`` of ``[sequences, steps]``: the n-step return
    ``r_t + ... + gamma^(n-1) r_(t+n-1) + gamma^n bootstrap_(t+n)``, summed up to the
    episode's end where it ends sooner (no bootstrap across a done), and whether the step
    has one: its window ends in a termination, or reaches ``t + n`` inside the sequence.
    A window cut by a truncation (a time limit) or by the sequence's end has none."""
    sequences, steps = reward.shape
    pad = reward.new_zeros(sequences, n)
    reward = torch.cat([reward, pad], 1)
    done = torch.cat([done, pad.bool()], 1)
    terminated = torch.cat([terminated, pad.bool()], 1)
    returns = torch.zeros_like(bootstrap)
    alive = torch.ones_like(bootstrap, dtype=torch.bool)  # no done so far in the window
    ended = torch.zeros_like(alive)  # the window ended in a termination
    for k in range(n):
        returns = returns + (gamma**k) * alive * reward[:, k : k + steps]
        ended = ended | (alive & terminated[:, k : k + steps])
        alive = alive & ~done[:, k : k + steps]
    later = torch.zeros_like(bootstrap)
    later[:, : steps - n] = bootstrap[:, n:]
    inside = torch.arange(steps, device=reward.device) + n < steps
    return returns + (gamma**n) * alive * later, ended | (alive & inside)


def rescale(x: torch.Tensor) -> torch.Tensor:
    """The paper's h(x) = sign(x) (sqrt(|x| + 1) - 1) + eps x."""
    return torch.sign(x) * (torch.sqrt(x.abs() + 1) - 1) + RESCALING_EPS * x


def rescale_inverse(x: torch.Tensor) -> torch.Tensor:
    """h's inverse: sign(x) (((sqrt(1 + 4 eps (|x| + 1 + eps)) - 1) / (2 eps))^2 - 1)."""
    eps = RESCALING_EPS
    return torch.sign(x) * (((torch.sqrt(1 + 4 * eps * (x.abs() + 1 + eps)) - 1) / (2 * eps)).pow(2) - 1)
