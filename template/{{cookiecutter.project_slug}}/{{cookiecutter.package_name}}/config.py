"""The run configuration: typed schema, defaults from ``config.yaml``, key=value overrides.

OmegaConf checks names and types against the dataclasses below, so a misspelt key or a
value of the wrong type is refused before any rank starts. The recipe's hyperparameters
(its ``Config`` dataclass) are mounted under ``algo``; its ``RUN_DEFAULTS`` (environment,
frames per batch, total frames) and, for runs on an env of a family it has settings for,
its ``FAMILY_DEFAULTS[family]`` sit under config.yaml, so either can override them.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from . import envs, recipes

# Fabric's own loggers and two of Lightning's experiment trackers (extras [wandb], [mlflow]).
LOGGERS = ("csv", "tensorboard", "wandb", "mlflow")
COLLECT_SYNC, COLLECT_ASYNC = "sync", "async"  # collector.mode
POLICY_ON_LEARNER, POLICY_ON_CPU, POLICY_AUTO = "learner", "cpu", "auto"  # collector.policy_device
REPLAY_STORAGES = ("memory", "memmap")  # replay.storage
# fabric.precision: Fabric's autocast around the learners' losses. Not "16-mixed": float16
# needs a gradient scaler, which the learners' plain backward does not apply.
PRECISIONS = ("32-true", "bf16-mixed")
# learners.batch_size_of: whose algo.batch_size and algo.updates_per_batch they are (replay recipes).
BATCH_OF_RUN, BATCH_OF_LEARNER = "run", "learner"


def one_folder(env_id: str) -> str:
    """An env id as one folder name: ALE/Pong-v5 -> ALE-Pong-v5 (not a folder ALE/)."""
    return str(env_id).replace("/", "-")


# ``${one_folder:${env.id}}`` in config.yaml: the default run_dir is runs/<recipe>-ALE-Pong-v5-seed1.
OmegaConf.register_new_resolver("one_folder", one_folder, replace=True)


def evaluation_interval(total_frames: int) -> int:
    """eval.every's default: 10,000 frames, or a twentieth of the run where that is more. A
    greedy episode can be long: an early agent can play an Atari game to its 108,000-frame
    cap, and evaluating every 10,000 frames then takes longer than training
    (docs/environments.md, "Evaluation and videos")."""
    return max(10_000, int(total_frames) // 20)


OmegaConf.register_new_resolver("evaluation_interval", evaluation_interval, replace=True)


# The labels of the config's layers (layers), as --print-config shows them.
SCHEMA, CONFIG_YAML, COMMAND_LINE = "default in config.py", "config.yaml", "command line"


class ConfigError(ValueError):
    """A problem with the user's configuration, reported as one line."""


@dataclass
class EnvConfig:
    id: str = MISSING
    num_envs: int = MISSING
    vectorization: str = MISSING
    kwargs: dict[str, Any] = field(default_factory=dict)
    # False unless the recipe's defaults for the env's family (or the user) turn them on.
    clip_rewards: bool = False
    life_loss: bool = False
    frame_stack: int = envs.FRAME_STACK
    threads: int | None = None


@dataclass
class CollectorConfig:
    frames_per_batch: int = MISSING
    mode: str = MISSING
    workers: int = MISSING
    weight_sync_every: int = MISSING
    policy_device: str = MISSING
    timeout: float = MISSING
    sync_frac: float = MISSING
    min_rollout_frac: float = MISSING


@dataclass
class ReplayConfig:
    processes: int = MISSING
    # capacity, alpha and batches_per_request: these unless the recipe's defaults (or the
    # user) say otherwise.
    capacity: int = 100_000
    alpha: float = 0.6
    beta: float = MISSING
    batches_per_request: int = 4
    storage: str = MISSING
    directory: str = MISSING


@dataclass
class EvalConfig:
    episodes: int = MISSING
    every: int = MISSING


@dataclass
class FabricConfig:
    accelerator: str = MISSING
    strategy: str = MISSING
    devices: int | None = None
    num_nodes: int = MISSING
    precision: str = MISSING


@dataclass
class RpcConfig:
    address: str | None = None
    port: int | None = None
    timeout: float = MISSING
    heartbeat_timeout: float = MISSING


@dataclass
class LearnersConfig:
    batch_size_of: str = MISSING
    share_gpu: bool = MISSING
    timeout: float = MISSING


@dataclass
class CheckpointConfig:
    every: int = MISSING
    keep: int = MISSING
    replay: bool = MISSING


@dataclass
class RunConfig:
    recipe: str = MISSING
    seed: int = MISSING
    total_frames: int = MISSING
    run_dir: str = MISSING
    threads: int | None = None
    compile: bool = MISSING
    cudagraphs: bool = MISSING
    log_every: int = MISSING
    loggers: list[str] = MISSING
    experiment: str = MISSING
    progress: bool = MISSING
    env: EnvConfig = field(default_factory=EnvConfig)
    collector: CollectorConfig = field(default_factory=CollectorConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    fabric: FabricConfig = field(default_factory=FabricConfig)
    rpc: RpcConfig = field(default_factory=RpcConfig)
    learners: LearnersConfig = field(default_factory=LearnersConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resume: str | None = None
    algo: Any = None


def load(overrides: list[str], defaults: Path) -> DictConfig:
    """Resolve ``defaults`` (a YAML file) plus ``key=value`` overrides into a checked config."""
    try:
        cfg = OmegaConf.merge(*(layer for _, layer in layers(overrides, defaults)))
        missing = sorted(OmegaConf.missing_keys(cfg))
        if missing:
            raise ConfigError(f"config keys without a value: {', '.join(missing)}")
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as error:
        raise ConfigError(_one_line(error)) from None
    validate(cfg)
    return cfg


def layers(overrides: list[str], defaults: Path) -> list[tuple[str, DictConfig]]:
    """The config's layers, lowest first, each with where it comes from: the schema (the
    recipe's Config under algo), the recipe's run defaults (its env, frames per batch,
    ...), its defaults for the family of the chosen env (Atari, MuJoCo, ...), config.yaml,
    the command line."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"expected key=value, got {item!r}")
    try:
        file = OmegaConf.load(defaults)
        cli = OmegaConf.from_dotlist(overrides)
        name = cli.get("recipe", file.get("recipe"))
        try:
            recipe = recipes.load(name)
        except recipes.RecipeError as error:
            raise ConfigError(str(error)) from None
        env_id = OmegaConf.merge(recipe.RUN_DEFAULTS, file, cli).env.id
        try:
            family = envs.family_of(env_id)
        except envs.EnvUnavailable as error:
            raise ConfigError(str(error)) from None
        schema = OmegaConf.structured(RunConfig)
        schema.algo = OmegaConf.structured(recipe.Config)
        OmegaConf.set_struct(schema, True)
        OmegaConf.set_struct(schema.env.kwargs, False)  # any keyword the env takes
        family_defaults = getattr(recipe, "FAMILY_DEFAULTS", {}).get(family, {})
        return [
            (SCHEMA, schema),
            (name, OmegaConf.create(recipe.RUN_DEFAULTS)),
            (f"{name}, {family} family", OmegaConf.create(family_defaults)),
            (CONFIG_YAML, file),
            (COMMAND_LINE, cli),
        ]
    except OmegaConfBaseException as error:
        raise ConfigError(_one_line(error)) from None


def sources(overrides: list[str], defaults: Path) -> dict[str, str]:
    """Where each key's value comes from: dotted key -> the label of the last layer that
    set it. The schema's defaults of the recipe's hyperparameters are its ``Config``'s."""
    stack = layers(overrides, defaults)
    recipe = stack[1][0]  # the recipe's run defaults are labelled with its name
    found = {}
    for source, layer in stack:
        for key, value in leaves(OmegaConf.to_container(layer)).items():
            if value == MISSING:  # ???: left to a layer above
                continue
            found[key] = f"{recipe} Config" if source == SCHEMA and key.startswith("algo.") else source
    return found


def leaves(tree: dict, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value of every leaf of a nested dict (an empty dict is a leaf)."""
    found = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            found.update(leaves(value, f"{prefix}{key}."))
        else:
            found[f"{prefix}{key}"] = value
    return found


def _one_line(error: OmegaConfBaseException) -> str:
    key = getattr(error, "full_key", None)
    message = str(getattr(error, "msg", error)).splitlines()[0]
    if type(error).__name__ == "ConfigKeyError" and key:
        return f"unknown config key '{key}'"
    return f"{key}: {message}" if key else message


def validate(cfg: DictConfig) -> None:
    """Range checks that a schema cannot express."""
    if cfg.total_frames <= 0:
        raise ConfigError(f"total_frames must be > 0, got {cfg.total_frames}")
    if cfg.env.num_envs <= 0:
        raise ConfigError(f"env.num_envs must be > 0, got {cfg.env.num_envs}")
    if cfg.collector.frames_per_batch <= 0:
        raise ConfigError(f"collector.frames_per_batch must be > 0, got {cfg.collector.frames_per_batch}")
    if cfg.threads is not None and cfg.threads < 1:
        raise ConfigError(f"threads must be >= 1 (null: the rank's share of the cores), got {cfg.threads}")
    if cfg.collector.frames_per_batch % cfg.env.num_envs:
        raise ConfigError(
            f"collector.frames_per_batch ({cfg.collector.frames_per_batch}) must be a multiple "
            f"of env.num_envs ({cfg.env.num_envs})"
        )
    agent = recipes.load(cfg.recipe).Agent
    if cfg.collector.mode not in (COLLECT_SYNC, COLLECT_ASYNC):
        raise ConfigError(
            f"collector.mode must be {COLLECT_SYNC} or {COLLECT_ASYNC}, got '{cfg.collector.mode}'"
        )
    if cfg.collector.mode == COLLECT_ASYNC and not agent.uses_replay:
        raise ConfigError(
            f"collector.mode=async is for replay recipes; '{cfg.recipe}' trains on what it just "
            "collected, so it collects in sync mode"
        )
    workers = cfg.collector.workers
    if workers < 1:
        raise ConfigError(f"collector.workers must be >= 1, got {workers}")
    if workers > 1 and cfg.env.num_envs % workers:
        raise ConfigError(
            f"env.num_envs ({cfg.env.num_envs}) must be a multiple of collector.workers ({workers}): "
            "each worker steps as many env copies"
        )
    if cfg.collector.policy_device not in (POLICY_ON_LEARNER, POLICY_ON_CPU, POLICY_AUTO):
        raise ConfigError(
            f"collector.policy_device must be {POLICY_ON_LEARNER}, {POLICY_ON_CPU} or {POLICY_AUTO}, "
            f"got '{cfg.collector.policy_device}'"
        )
    for key in ("collector.weight_sync_every", "collector.timeout"):
        if OmegaConf.select(cfg, key) <= 0:
            raise ConfigError(f"{key} must be > 0, got {OmegaConf.select(cfg, key)}")
    for key in ("collector.sync_frac", "collector.min_rollout_frac"):
        if not 0 < OmegaConf.select(cfg, key) <= 1:
            raise ConfigError(f"{key} must be in (0, 1], got {OmegaConf.select(cfg, key)}")
    if cfg.replay.processes < 0:
        raise ConfigError(f"replay.processes must be >= 0, got {cfg.replay.processes}")
    if agent.uses_replay and cfg.replay.processes < 1 and expected_world_size(cfg) != 1:
        raise ConfigError("replay.processes must be >= 1 for a replay recipe on several learners")
    if cfg.checkpoint.every < 0:
        raise ConfigError(f"checkpoint.every must be >= 0, got {cfg.checkpoint.every}")
    if cfg.checkpoint.keep < 1:
        raise ConfigError(f"checkpoint.keep must be >= 1, got {cfg.checkpoint.keep}")
    for key in ("rpc.timeout", "rpc.heartbeat_timeout", "learners.timeout"):
        if OmegaConf.select(cfg, key) <= 0:
            raise ConfigError(f"{key} must be > 0, got {OmegaConf.select(cfg, key)}")
    if cfg.replay.alpha < 0:
        raise ConfigError(f"replay.alpha must be >= 0 (0: uniform), got {cfg.replay.alpha}")
    if cfg.replay.batches_per_request < 1:
        raise ConfigError(f"replay.batches_per_request must be >= 1, got {cfg.replay.batches_per_request}")
    if cfg.replay.storage not in REPLAY_STORAGES:
        raise ConfigError(
            f"replay.storage must be {' or '.join(REPLAY_STORAGES)}, got '{cfg.replay.storage}'"
        )
    whose, choices = cfg.learners.batch_size_of, f"{BATCH_OF_RUN} or {BATCH_OF_LEARNER}"
    if whose not in (BATCH_OF_RUN, BATCH_OF_LEARNER):
        raise ConfigError(f"learners.batch_size_of must be {choices}, got '{whose}'")
    if cfg.learners.share_gpu and cfg.fabric.accelerator not in ("auto", "cuda"):
        on = cfg.fabric.accelerator
        raise ConfigError(f"learners.share_gpu=true puts the learners on a GPU; fabric.accelerator is {on}")
    if cfg.learners.share_gpu and not torch.cuda.is_available():
        raise ConfigError("learners.share_gpu=true needs a CUDA GPU; torch finds none")
    batch_size = getattr(cfg.algo, "batch_size", 0)
    if batch_size > cfg.replay.capacity:
        raise ConfigError(f"algo.batch_size ({batch_size}) exceeds replay.capacity ({cfg.replay.capacity})")
    unknown = sorted(set(cfg.loggers) - set(LOGGERS))
    if unknown:
        raise ConfigError(f"unknown logger '{unknown[0]}' in loggers (choose from {', '.join(LOGGERS)})")
    for tracker in [name for name in ("wandb", "mlflow") if name in cfg.loggers]:
        # Lightning's loggers for them come with the extra too (pytorch_lightning).
        missing = [name for name in (tracker, "pytorch_lightning") if importlib.util.find_spec(name) is None]
        if missing:
            raise ConfigError(f"loggers: {tracker} needs {missing[0]} (pip install -e '.[{tracker}]')")
    if cfg.fabric.precision not in PRECISIONS:
        raise ConfigError(
            f"fabric.precision must be {' or '.join(PRECISIONS)}, got '{cfg.fabric.precision}' "
            "(16-mixed needs a gradient scaler, which the learners do not use: bf16-mixed does without)"
        )
    if cfg.eval.episodes < 0:
        raise ConfigError(f"eval.episodes must be >= 0 (0: no evaluation), got {cfg.eval.episodes}")
    if cfg.eval.every < 0:
        raise ConfigError(f"eval.every must be >= 0 (0: only at the end), got {cfg.eval.every}")
    if cfg.env.vectorization not in envs.VECTORIZATIONS:
        choices = ", ".join(envs.VECTORIZATIONS)
        raise ConfigError(f"env.vectorization must be one of {choices}, got '{cfg.env.vectorization}'")
    try:
        family = envs.family_of(cfg.env.id)
        envs.vectorization_of(cfg.env.vectorization, cfg.env.id)
        kind, actions = envs.actions_of(cfg.env)
    except envs.EnvUnavailable as error:
        raise ConfigError(str(error)) from None
    if cfg.env.life_loss and family != envs.ATARI:
        raise ConfigError(f"env.life_loss is for Atari games ({cfg.env.id} is not one)")
    if cfg.env.frame_stack != envs.FRAME_STACK and family != envs.ATARI:
        raise ConfigError(f"env.frame_stack is for Atari games ({cfg.env.id} is not one)")
    if cfg.env.frame_stack < 1:
        raise ConfigError(f"env.frame_stack must be >= 1, got {cfg.env.frame_stack}")
    if cfg.env.threads is not None and cfg.env.threads < 1:
        raise ConfigError(f"env.threads must be >= 1 (null: the rank's share), got {cfg.env.threads}")
    if kind not in agent.action_spaces:
        needs = " or ".join(agent.action_spaces)
        raise ConfigError(f"recipe {cfg.recipe} needs {needs} actions; {cfg.env.id} has {actions}")


def check_learners(cfg: DictConfig, device: torch.device, learners: int) -> None:
    """What the run asks of the learners' device and number, once Fabric has chosen them."""
    batch_size = getattr(cfg.algo, "batch_size", learners)
    if cfg.learners.batch_size_of == BATCH_OF_RUN and batch_size < learners:
        raise ConfigError(
            f"algo.batch_size ({batch_size}) is dealt out over the learners (learners.batch_size_of=run): "
            f"it needs at least one transition for each of the {learners}"
        )
    if cfg.cudagraphs and device.type != "cuda":
        raise ConfigError(f"cudagraphs=true needs a CUDA device; the learners run on {device.type}")


def learner_device(cfg: DictConfig, fabric_device: torch.device) -> torch.device:
    """Where a learner trains: Fabric's device for its rank, or with ``learners.share_gpu``
    GPU 0 for every learner (Fabric then starts them as CPU ranks: gloo between them)."""
    return torch.device("cuda", 0) if cfg.learners.share_gpu else fabric_device


def acts_on_cpu(cfg: DictConfig, device: torch.device) -> bool:
    """Whether a learner on ``device`` gives its sync collector a CPU copy of its policy,
    refreshed before each batch (``collector.policy_device``). ``auto``: on a GPU, for all
    but Atari. Where the env copies are few and the network small, a forward pass on the CPU
    costs less than the GPU's kernel launches and copies at every env step; over Atari
    frames the convolutions cost less on the GPU (docs/benchmarks.md, "Where the collector's
    policy acts")."""
    if cfg.collector.mode == COLLECT_ASYNC or cfg.collector.workers > 1:
        return False  # a collector's processes act with a CPU copy of their own
    if cfg.collector.policy_device == POLICY_AUTO:
        return device.type != "cpu" and envs.family_of(cfg.env.id) != envs.ATARI
    return cfg.collector.policy_device == POLICY_ON_CPU


def expected_world_size(cfg: DictConfig) -> int | None:
    """The number of ranks, where it is known before the launcher starts them."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    devices = cfg.fabric.devices if cfg.fabric.devices is not None else os.environ.get("LT_DEVICES")
    if devices is None:
        return 1
    nodes = int(os.environ.get("LT_NUM_NODES", cfg.fabric.num_nodes))
    return int(devices) * nodes if str(devices).isdigit() else None


def learner_batch(cfg: DictConfig, learners: int, index: int) -> tuple[int, int, float]:
    """A replay recipe's learner ``index``: its transitions per update, its updates per
    collector step, and its loss's weight in the learners' average of gradients.

    learners.batch_size_of=run: ``algo.batch_size`` and ``algo.updates_per_batch`` are the
    run's, so N learners train as one learner does per frame. They collect N times its
    frames a step, so they make N times its updates, each on ``batch_size`` transitions
    dealt out over them, the first ``batch_size % N`` learners taking one more. DDP averages
    the learners' gradients; each loss (a mean over its share) weighted by share x N /
    batch_size makes that average the gradient of the whole batch.
    learners.batch_size_of=learner: each learner's own, N times the transitions per update
    and 1/N the updates per frame.
    """
    batch, updates = cfg.algo.batch_size, cfg.algo.updates_per_batch
    if cfg.learners.batch_size_of == BATCH_OF_LEARNER:
        return batch, updates, 1.0
    share = batch // learners + (index < batch % learners)
    return share, updates * learners, share * learners / batch


def planned_frames(cfg: DictConfig, learners: int, start: int = 0) -> int:
    """``total_frames`` rounded up to whole collector steps of all learners, counted on
    from ``start`` (a resumed run's frames, in steps of however many learners it had)."""
    frames_per_step = cfg.collector.frames_per_batch * learners
    return start + math.ceil(max(0, cfg.total_frames - start) / frames_per_step) * frames_per_step
