"""Environments by family: which library makes them, how they are preprocessed and batched.

``env.id`` names any registered gymnasium env; its family (read from the id's registered
entry point) decides the standard treatment:

- ``atari`` (``ALE/Pong-v5``, ...; extra ``[atari]``): the DQN-paper preprocessing, done
  by ale-py itself: 30 no-op starts, 4 frames skipped with a max-pool over the last two,
  84x84 grey, the last 4 frames stacked, newest last: ``uint8 (4, 84, 84)``
  (``env.frame_stack`` frames: ``1`` for a recurrent policy, which remembers for itself).
  Rewards are the raw game score; ``env.clip_rewards`` and ``env.life_loss`` change what
  training sees (clipped rewards, a life lost as a terminal state: ``TrainingBatches``)
  and never what is reported or evaluated.
- ``minatar`` (``MinAtar/Breakout-v1``, ...; extra ``[minatar]``): the ``10x10xC`` bool
  grid as ``uint8 (C, 10, 10)``, channels first as convolutions want them.
- ``mujoco`` (``HalfCheetah-v5``, ...; extra ``[mujoco]``): float64 observations as float32.
- ``popgym`` (``popgym-PositionOnlyCartPoleEasy-v0``, ...; extra ``[popgym]``): POPGym's
  partially observed envs, as gymnasium makes them.
- ``other``: anything else (classic control, your own envs), as gymnasium makes it.

In every family, discrete observations (``Discrete``, ``MultiDiscrete``, ``MultiBinary``:
FrozenLake's cell, Taxi's state, POPGym's cards) reach the networks as one-hot float32
vectors; other spaces than these and ``Box`` are refused in one line.

``env.vectorization`` picks how one learner's ``env.num_envs`` copies are stepped:
``sync`` (one process, gymnasium's ``SyncVectorEnv``), ``async`` (a subprocess per copy,
``AsyncVectorEnv``), ``ale`` (ale-py's native ``AtariVectorEnv``, threads in C++; Atari
only), or ``auto``: ``ale`` for Atari, ``sync`` for the rest (docs/environments.md,
"Vectorization", has the measurements behind the rule).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torchrl.data import Categorical, OneHot, Unbounded
from torchrl.envs import (
    DTypeCastTransform,
    EnvBase,
    GymWrapper,
    PermuteTransform,
)
from torchrl.envs.libs.gym import default_info_dict_reader
from torchrl.modules import get_env_transforms_from_module, get_primers_from_module

ATARI, MINATAR, MUJOCO, POPGYM, OTHER = "atari", "minatar", "mujoco", "popgym", "other"
SYNC, ASYNC, ALE, AUTO = "sync", "async", "ale", "auto"  # env.vectorization
DISCRETE, CONTINUOUS = "discrete", "continuous"  # kinds of action spaces (a recipe's action_spaces)
VECTORIZATIONS = (AUTO, SYNC, ASYNC, ALE)
# The module a family needs, and the project's extra that installs it.
NEEDS = {
    ATARI: ("ale_py", "atari"),
    MINATAR: ("minatar", "minatar"),
    MUJOCO: ("mujoco", "mujoco"),
    POPGYM: ("popgym", "popgym"),
}
# Id prefixes registered only once their package is imported: a missing package then
# shows as an unregistered id, and the prefix says which extra would register it.
PREFIXES = {"ALE/": ATARI, "MinAtar/": MINATAR, "popgym-": POPGYM}
ENTRY_POINTS = {"ale_py": ATARI, "minatar": MINATAR, "gymnasium.envs.mujoco": MUJOCO, "popgym": POPGYM}
# The observation spaces that reach a network as one-hot vectors.
DISCRETE_OBSERVATIONS = (gym.spaces.Discrete, gym.spaces.MultiDiscrete, gym.spaces.MultiBinary)
# The DQN paper's preprocessing (Mnih et al. 2015, as in Machado et al. 2018 and CleanRL).
FRAME_SKIP, FRAME_STACK, SCREEN_SIZE, NOOP_MAX = 4, 4, 84, 30
LIVES = "lives"
MAX_EPISODE_STEPS = 10_000  # for envs whose registration sets no limit


class EnvUnavailable(ValueError):
    """An env id that is not registered, or whose family's package is not installed."""


def family_of(env_id: str) -> str:
    """The family of a registered env id; EnvUnavailable names the pip command when the
    family's package is missing."""
    name = registered_name(env_id)
    family = next((fam for prefix, fam in PREFIXES.items() if name.startswith(prefix)), None)
    if name not in gym.registry and family is not None:
        if not installed(NEEDS[family][0]):
            raise missing_extra(env_id, family)
        register_envs(family)
    if name not in gym.registry:
        raise EnvUnavailable(f"unknown env id '{env_id}' (not registered with gymnasium)")
    entry_point = gym.spec(name).entry_point
    entry_point = entry_point if isinstance(entry_point, str) else entry_point.__module__
    family = next((fam for prefix, fam in ENTRY_POINTS.items() if entry_point.startswith(prefix)), OTHER)
    if family in NEEDS and not installed(NEEDS[family][0]):
        raise missing_extra(env_id, family)
    return family


def registered_name(env_id: str) -> str:
    """``env_id`` without gymnasium's ``module:EnvId`` prefix, once that module is imported
    (it registers the env, as ``gym.make`` imports it first); ``gym.spec`` refuses the form."""
    module, _, name = env_id.rpartition(":")
    if module:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise EnvUnavailable(f"env.id '{env_id}': cannot import module '{module}' ({error})") from None
    return name


def missing_extra(env_id: str, family: str) -> EnvUnavailable:
    module, extra = NEEDS[family]
    return EnvUnavailable(f"env.id={env_id} needs {module}: pip install -e '.[{extra}]'")


def installed(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


@functools.cache
def register_envs(family: str) -> None:
    """Register the ids of ``family``'s package: ale-py, minatar and popgym register theirs
    only when asked or imported (gymnasium 1.x loads no plugins by itself). One family at a
    time: importing minatar takes seconds (it imports seaborn), which an Atari run need not
    pay."""
    if family == ATARI:
        import ale_py

        gym.register_envs(ale_py)
    elif family == MINATAR:
        import minatar.gym

        minatar.gym.register_envs()
    elif family == POPGYM:
        import popgym

        gym.register_envs(popgym)


def actions_of(env: Mapping[str, Any]) -> tuple[str | None, str]:
    """The kind of one copy's action space (DISCRETE, CONTINUOUS, or None for any other)
    and its description, e.g. ``"2 discrete actions"``: from one copy of the env as
    training makes it, before any rank starts. EnvUnavailable says, in one line, why it
    cannot be made."""
    try:
        with output_silenced():
            probe = make_env(env, 1, seed=0, training=False)
            spec = probe.action_spec_unbatched
            probe.close()
    except EnvUnavailable:
        raise
    except Exception as error:  # a bad keyword, a broken user env: say which, in one line
        raise EnvUnavailable(f"env.id={env['id']} cannot be made: {str(error).splitlines()[0]}") from None
    if isinstance(spec, (OneHot, Categorical)):
        return DISCRETE, f"{spec.space.n} discrete actions"
    if spec.dtype.is_floating_point:
        dimensions = spec.shape.numel()
        return CONTINUOUS, f"continuous actions ({dimensions} dimension{'s' if dimensions > 1 else ''})"
    return None, f"{type(spec).__name__} actions"


@contextlib.contextmanager
def output_silenced() -> Iterator[None]:
    """Standard error and Python warnings off for the block, at the file descriptor: the
    MuJoCo compiler prints its own deprecation warnings from C, where neither Python's
    ``warnings`` nor ``sys.stderr`` reach them."""
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def vectorization_of(requested: str, env_id: str) -> str:
    """``auto`` resolved by the measured rule: ale-py's own vector env is the fastest for
    Atari; for the rest, subprocesses cost more than cheap envs take to step."""
    family = family_of(env_id)
    if requested == AUTO:
        return ALE if family == ATARI else SYNC
    if requested == ALE and family != ATARI:
        raise EnvUnavailable(f"env.vectorization=ale is for Atari games ({env_id} is not one)")
    return requested


def make_env(
    env: str | Mapping[str, Any],
    num_envs: int,
    seed: int,
    device: torch.device | str | None = "cpu",
    training: bool = True,
    policy: TensorDictModuleBase | None = None,
) -> EnvBase:
    """``num_envs`` copies of an env stepped as one batch, as a seeded torchrl env, which
    carries the recurrent state of ``policy``, if it has one (``with_recurrent_state``).

    ``env`` is an env id or the run's ``env`` config (``id``, ``vectorization``, ``kwargs``,
    ``life_loss``, ``frame_stack``, ``threads``); missing keys take their defaults.
    Rewards are raw: ``TrainingBatches`` makes what training sees from a collector's
    batches. ``training=False`` (evaluation) resets each copy within the step that ends its
    episode (gymnasium's same-step autoreset), which evaluation's rollout needs, and reads
    no lives.
    ``device=None``: the env's tensors carry no device (they are on the CPU), which spares
    torchrl a cast of every step's tensordict (the collector's choice, see ``collector.py``).
    """
    env = {"id": env} if isinstance(env, str) else env
    env_id = env["id"]
    family = family_of(env_id)
    backend = vectorization_of(env.get("vectorization", AUTO), env_id)
    kwargs = dict(env.get("kwargs") or {})
    frame_stack = env.get("frame_stack", FRAME_STACK)
    # Training leaves autoreset to torchrl (gymnasium's DISABLED mode): it resets finished
    # copies through a mask, where same-step autoreset costs a Python loop over the copies
    # at every step.
    autoreset = gym.vector.AutoresetMode.DISABLED if training else gym.vector.AutoresetMode.SAME_STEP
    if backend == ALE:
        # ale-py's threads default to as many as the machine has cores (C++'s
        # hardware_concurrency), for each learner of a node and whatever SLURM gave it:
        # env.threads, which train.py sets to the rank's share, bounds them.
        if env.get("threads"):
            kwargs.setdefault("num_threads", env["threads"])
        # ale-py's vector env has no DISABLED mode: MaskedResets makes one of its NEXT_STEP mode.
        vector_env = gym.make_vec(
            env_id,
            num_envs=num_envs,
            vectorization_mode="vector_entry_point",
            autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP if training else autoreset,
            **atari_vector_settings(kwargs, frame_stack),
        )
        if training:
            vector_env = MaskedResets(vector_env)
    else:
        vector_env = gym.make_vec(
            env_id,
            num_envs=num_envs,
            vectorization_mode=backend,
            vector_kwargs={"autoreset_mode": autoreset},
            wrappers=[
                functools.partial(atari_preprocessing, frame_stack=frame_stack)
                if family == ATARI
                else network_observations
            ]
            + ([] if training else [WithoutInfo]),
            **(atari_single_settings(kwargs) if family == ATARI else kwargs),
        )
    if isinstance(vector_env.single_action_space, gym.spaces.Box):
        vector_env = ClippedActions(vector_env)
    life_loss = training and env.get("life_loss", False)
    return with_recurrent_state(as_torchrl(vector_env, seed, device, family, read_lives=life_loss), policy)


def with_recurrent_state(env: EnvBase, policy: TensorDictModuleBase | None) -> EnvBase:
    """``env`` with the transforms that a policy with recurrent modules (torchrl's
    ``LSTMModule``, ``GRUModule``) needs, from torchrl's ``get_env_transforms_from_module``:
    ``InitTracker`` marks each episode's first step (``is_init``), and the modules'
    primer puts their state in each step, zeros at a reset, the state after a step
    (``("next", ...)``, which the policy writes) becoming the next step's. ``env`` as it
    is for any other policy."""
    if policy is None or get_primers_from_module(policy, warn=False) is None:
        return env
    return env.append_transform(get_env_transforms_from_module(policy))


def clip_to(space: gym.spaces.Box) -> Callable[[np.ndarray], np.ndarray]:
    """Actions clipped to ``space``'s bounds on their way into the env: a policy may sample
    beyond them (PPO's Gaussian), and training keeps the action it sampled (CleanRL's
    ``ClipAction``). gymnasium's ``ClipAction`` would also widen the action space to
    infinity, and torchrl builds the action spec, whose bounds SAC and TD3 squash into,
    from it."""
    return functools.partial(np.clip, a_min=space.low, a_max=space.high)


class ClippedActions(gym.wrappers.vector.TransformAction):
    """gymnasium's action transform with ``clip_to``, which keeps the env's action space and
    its autoreset mode (torchrl reads it from the vector env it wraps)."""

    def __init__(self, env: gym.vector.VectorEnv) -> None:
        super().__init__(env, clip_to(env.action_space), env.action_space, env.single_action_space)
        self.autoreset_mode = env.metadata["autoreset_mode"]


class WithoutInfo(gym.Wrapper):
    """An env whose resets and steps return no info, for evaluation, which reads none. In
    same-step autoreset mode torchrl reads every info key, typed as the first value it
    sees: FrozenLake's ``prob``, an int at a reset and a float at a step, broke rollouts."""

    def reset(self, **kwargs) -> tuple[Any, dict]:
        observation, _ = self.env.reset(**kwargs)
        return observation, {}

    def step(self, action) -> tuple[Any, Any, bool, bool, dict]:
        observation, reward, terminated, truncated, _ = self.env.step(action)
        return observation, reward, terminated, truncated, {}


class MaskedResets(gym.vector.VectorWrapper):
    """ale-py's vector env in gymnasium's DISABLED autoreset mode: a finished game waits
    for torchrl to reset it through ``reset(options={"reset_mask": ...})``.

    ale-py's core has no DISABLED mode, only NEXT_STEP and SAME_STEP. Its NEXT_STEP mode
    with masked resets is DISABLED's contract: a game reset through the mask is not reset
    again at the next step (tests/test_env_families.py holds ale-py to it), and torchrl
    resets every finished copy before it steps again. In SAME_STEP mode torchrl instead
    reads each step's final observations from ``info``: a zeroed frame stack and a loop
    over the copies at every step, a sixth of the collector's time on Pong
    (docs/distributed.md, "The data path").
    """

    autoreset_mode = gym.vector.AutoresetMode.DISABLED

    def __init__(self, env: gym.vector.VectorEnv) -> None:
        if env.metadata.get("autoreset_mode") != gym.vector.AutoresetMode.NEXT_STEP:
            raise ValueError(f"MaskedResets wraps a vector env in NEXT_STEP autoreset mode, not {env}")
        super().__init__(env)
        self.metadata = {**env.metadata, "autoreset_mode": self.autoreset_mode}


def atari_vector_settings(kwargs: dict[str, Any], frame_stack: int = FRAME_STACK) -> dict[str, Any]:
    """ale-py's vector env, set as gymnasium's wrappers below preprocess single envs, so
    that every backend, evaluation and the videos play the same game: raw rewards (clipped
    later, for training only), no life-loss terminal (added later, for training only), no
    FIRE pressed at reset (gymnasium's AtariPreprocessing has none; Machado et al. 2018
    advise against it too)."""
    settings = {
        "stack_num": frame_stack,
        "img_height": SCREEN_SIZE,
        "img_width": SCREEN_SIZE,
        "noop_max": NOOP_MAX,
        "reward_clipping": False,
        "episodic_life": False,
        "use_fire_reset": False,
    }
    return {**settings, **kwargs}


def network_observations(env: gym.Env) -> gym.Env:
    """Observations as the networks take them: discrete ones (``DISCRETE_OBSERVATIONS``) as
    float32 one-hot vectors (gymnasium's ``FlattenObservation``; a ``MultiDiscrete``'s
    one-hots side by side), float64 vectors (MuJoCo's) as float32, other ``Box``
    observations as they are. EnvUnavailable names any other space.

    Cast in each env rather than by torchrl's ``DoubleToFloat`` transform: a step of one
    Hopper took 0.28 ms through torchrl against 0.31 with the transform (gymnasium's own
    step: 0.10 ms)."""
    space = env.observation_space
    if isinstance(space, DISCRETE_OBSERVATIONS):
        env = gym.wrappers.FlattenObservation(env)  # one-hot, in the space's integer dtype
    elif not isinstance(space, gym.spaces.Box):
        name = env.spec.id if env.spec is not None else type(env.unwrapped).__name__
        raise EnvUnavailable(
            f"env.id={name} has {type(space).__name__} observations: the recipes take Box, "
            f"Discrete, MultiDiscrete or MultiBinary ones"
        )
    elif space.dtype != np.float64:
        return env
    space = env.observation_space
    # The bounds cast here: gymnasium's DtypeObservation warns that it lowers their precision.
    space = gym.spaces.Box(space.low.astype(np.float32), space.high.astype(np.float32), dtype=np.float32)
    return gym.wrappers.TransformObservation(env, functools.partial(np.asarray, dtype=np.float32), space)


def atari_single_settings(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The emulator steps single frames: AtariPreprocessing skips and max-pools them."""
    return {**kwargs, "frameskip": 1}


def atari_preprocessing(env: gym.Env, frame_stack: int = FRAME_STACK) -> gym.Env:
    """The preprocessing of ale-py's vector env, from gymnasium's wrappers, for one env."""
    env = gym.wrappers.AtariPreprocessing(
        env, noop_max=NOOP_MAX, frame_skip=FRAME_SKIP, screen_size=SCREEN_SIZE, terminal_on_life_loss=False
    )
    return gym.wrappers.FrameStackObservation(env, frame_stack)


def as_torchrl(
    gym_env: gym.Env,
    seed: int,
    device: torch.device | str | None = "cpu",
    family: str = OTHER,
    read_lives: bool = False,
) -> EnvBase:
    """A gymnasium env as a seeded torchrl env. ``read_lives``: steps also carry the Atari
    game's ``lives`` (for ``TrainingBatches``' life-loss terminals)."""
    env = GymWrapper(gym_env, device=device)
    if read_lives:
        # In DISABLED autoreset mode (training's) torchrl reads no info key by itself.
        spec = Unbounded(shape=env.batch_size, dtype=torch.int64)
        env.set_info_dict_reader(default_info_dict_reader([LIVES], spec={LIVES: spec}))
    # A wrapped vector env may already be a TransformedEnv and appends in place; any other
    # env comes back wrapped in a new one: use what append_transform returns.
    if family == MINATAR:
        # Bool grids, channels last: uint8 (one byte, like Atari's pixels), channels first.
        env = env.append_transform(DTypeCastTransform(torch.bool, torch.uint8, in_keys=["observation"]))
        env = env.append_transform(PermuteTransform((-1, -3, -2), in_keys=["observation"]))
    env.set_seed(seed)
    return env


class TrainingBatches:
    """A training collector's ``postproc``: adds each step's ``("next", "episode_reward")``,
    the raw score of its episode so far, from which the learner reports the returns of
    finished episodes; then makes the training-only changes: rewards clipped to [-1, 1]
    (``env.clip_rewards``) and a lost life terminal (``env.life_loss``).

    Batches are ``[env copies, steps]`` and follow each other in time: each copy's score
    carries over from one batch to the next. torchrl's ``RewardSum`` transform keeps the
    same sums inside the env, at every step through its step and reset paths: it cost a
    fifth of the collector's frames/s on 32 CartPoles (``benchmarks/collection.py``, 0.36
    against 0.44 of the plain loop), where this is two tensor operations per step of a
    batch.
    """

    def __init__(self, clip_rewards: bool = False, life_loss: bool = False) -> None:
        self.clip_rewards = clip_rewards
        self.life_loss = life_loss
        self.scores: torch.Tensor | None = None  # each copy's score so far

    def __call__(self, batch: TensorDictBase) -> TensorDictBase:
        reward, done = batch["next", "reward"], batch["next", "done"]
        running = torch.zeros_like(reward[:, 0]) if self.scores is None else self.scores
        scores = []
        # Each step's slices taken at once (unbind) and the scores stacked at the end:
        # indexing and writing one step at a time took a third more (17 against 13 ms
        # for 2,048 steps of one Hopper).
        for step_reward, step_done in zip(reward.unbind(1), done.unbind(1), strict=True):
            running = running + step_reward
            scores.append(running)
            running = running.masked_fill(step_done, 0)
        self.scores = running
        batch["next", "episode_reward"] = torch.stack(scores, 1)
        if self.clip_rewards:
            batch["next", "reward"] = reward.clamp(-1.0, 1.0)
        if self.life_loss:
            # Done here, on the batch: a terminal signal inside the env would make torchrl
            # reset the game, and torchrl's ``EndOfLifeTransform`` reads the lives of a
            # single ALE env, which ale-py's vector env does not expose (its ``info`` does).
            # ``done`` still marks the game's end.
            lost = batch["next", LIVES] < batch[LIVES]
            terminated = batch["next", "terminated"]
            batch["next", "terminated"] = terminated | lost.reshape(terminated.shape)
        return batch


def max_episode_steps(env_id: str) -> int:
    return gym.spec(registered_name(env_id)).max_episode_steps or MAX_EPISODE_STEPS


def make_video_env(
    env: Mapping[str, Any], folder: str, seed: int, policy: TensorDictModuleBase | None = None
) -> EnvBase:
    """One copy of the env, each episode recorded to an mp4 in ``folder`` by gymnasium's
    ``RecordVideo`` (needs moviepy; pygame for classic control). The recorder sees the
    game as rendered (Atari: the colour screen at every emulator frame), the agent the
    preprocessed observations, as in training."""
    env_id = env["id"]
    family = family_of(env_id)
    kwargs = dict(env.get("kwargs") or {})
    if family == ATARI:
        kwargs = atari_single_settings(kwargs)
    game = gym.make(env_id, render_mode="rgb_array", **kwargs)
    if isinstance(game.action_space, gym.spaces.Box):
        game = gym.wrappers.TransformAction(game, clip_to(game.action_space), game.action_space)
    game = network_observations(game)
    if family == MINATAR:
        game = MinAtarFrames(game)
    recorder = gym.wrappers.RecordVideo(
        game,
        folder,
        # Episode 0 is the reset with which torchrl seeds the env: not an episode played.
        episode_trigger=lambda episode: episode > 0,
        name_prefix=env_id.replace("/", "-"),
        disable_logger=True,
    )
    if family == ATARI:
        recorder = atari_preprocessing(recorder, env.get("frame_stack", FRAME_STACK))
    return with_recurrent_state(as_torchrl(recorder, seed, family=family), policy)


class MinAtarFrames(gym.Wrapper):
    """MinAtar renders its 10x10 grid as float RGB in [0, 1]; video encoders want uint8 at a
    size players can see. No gymnasium wrapper scales renders, hence this one."""

    SCALE = 32

    def render(self) -> np.ndarray:
        frame = (np.asarray(self.env.render()) * 255).astype(np.uint8)
        return frame.repeat(self.SCALE, axis=0).repeat(self.SCALE, axis=1)
