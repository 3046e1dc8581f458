"""Checkpoints on disk: the trained agent, and the whole training state to resume from.

``checkpoints/final.pt`` is what ``evaluate.py`` loads: it names the recipe, the
environment and the recipe's hyperparameters next to the agent's weights, so the agent can
be rebuilt without the run's config file.

``checkpoints/frames-<N>/`` (every ``checkpoint.every`` frames) holds everything a run
needs to go on from frame N (``resume=``): ``meta.json`` (recipe, env, layout, counters),
``agent.pt`` (weights with their target networks, the optimizers' states), ``rng-<i>.pt``
(each learner's random generators, its GPU's included) and ``replay-<i>/`` (each replay
shard's contents and priorities; left out with ``checkpoint.replay=false``, for buffers
too large to copy each time). It is written under a temporary name and renamed when
complete, so a crash while writing leaves the previous checkpoint as it was.

A run may go on with another number of learners or replay shards than the checkpoint's:
the learners are identical (one ``agent.pt``), learner i takes ``rng-<i>.pt`` when there
is one and seeds fresh generators otherwise, and the shards' transitions are dealt out
anew (``ReplayShard.restore``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pickle
import random
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
import yaml  # omegaconf's own parser: what OmegaConf.load raises on a damaged file
from lightning_fabric.utilities.seed import seed_everything
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from . import logs, recipes
from .config import ConfigError
from .distributed.watchdog import RankFailure

log = logging.getLogger(__name__)

FINAL = Path("checkpoints") / "final.pt"
PREFIX = "frames-"
META = "meta.json"
AGENT = "agent.pt"


@dataclass(frozen=True)
class Meta:
    """What a training checkpoint is: ``meta.json``, written last (a folder without it is
    incomplete), and read back by ``resume``."""

    recipe: str
    env_id: str
    frames: int
    updates: int
    learners: int
    replay_shards: int
    replay: bool  # the shards' contents are in the checkpoint (checkpoint.replay)
    frames_per_batch: int
    # Every other file of the checkpoint and its size in bytes, as written: a resume finds a
    # file that is missing or was cut short (a disk that failed, a copy that did not finish).
    files: dict[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def of_run(cls, cfg: DictConfig, frames: int, updates: int, learners: int, replay_shards: int) -> Meta:
        """The meta of a checkpoint of the run ``cfg`` after ``frames`` and ``updates``."""
        return cls(
            recipe=cfg.recipe,
            env_id=cfg.env.id,
            frames=frames,
            updates=updates,
            learners=learners,
            replay_shards=replay_shards,
            replay=replay_shards > 0 and cfg.checkpoint.replay,
            frames_per_batch=cfg.collector.frames_per_batch,
        )

    def write(self, folder: Path) -> None:
        (folder / META).write_text(json.dumps(dataclasses.asdict(self), indent=2))

    @classmethod
    def read(cls, folder: Path) -> Meta:
        return cls(**json.loads((folder / META).read_text()))


@dataclass(frozen=True)
class Checkpoint(Meta):
    """A training checkpoint on disk: its meta and its folder."""

    folder: Path = dataclasses.field(kw_only=True)

    def changes(self, learners: int, shards: int) -> list[str]:
        """How a run of ``learners`` and ``shards`` replay shards differs from this
        checkpoint's, e.g. ``["learners 2 -> 3"]``."""
        layout = {"learners": (self.learners, learners), "replay shards": (self.replay_shards, shards)}
        return [f"{key} {saved} -> {now}" for key, (saved, now) in layout.items() if saved != now]


def save(
    cfg: DictConfig,
    meta: Meta,
    learner_index: int,
    agent: torch.nn.Module,
    optimizers: dict[str, torch.optim.Optimizer],
    shards: Sequence[Any],
    barrier: Callable[[], None],
) -> None:
    """Write the training checkpoint ``meta`` describes. Every learner calls this at the
    same step, once its own replay writes are in; ``barrier`` waits for all learners, so
    the shards (RRefs, ``shards``) do not change while they are written and none goes on
    before the checkpoint is complete."""
    final = training_dir(cfg.run_dir, meta.frames)
    partial = partial_dir(final)
    try:
        if learner_index == 0:
            shutil.rmtree(partial, ignore_errors=True)  # what a crash in an earlier write left
            partial.mkdir(parents=True)
        barrier()
        torch.save(rng_state(), partial / f"rng-{learner_index}.pt")
        barrier()
        if learner_index == 0:
            optimizer_states = {name: optimizer.state_dict() for name, optimizer in optimizers.items()}
            torch.save({"agent": agent.state_dict(), "optimizers": optimizer_states}, partial / AGENT)
            if meta.replay:
                for index, shard in enumerate(shards):
                    shard.rpc_sync().save(str(partial / f"replay-{index}"))
            files = {
                str(path.relative_to(partial)): path.stat().st_size
                for path in partial.rglob("*")
                if path.is_file()
            }
            dataclasses.replace(meta, files=files).write(
                partial
            )  # last: a folder without meta.json is incomplete
            commit(partial, final, cfg.checkpoint.keep)
    except OSError as error:  # a full disk, say: the checkpoints before this one stay as they were
        raise RankFailure(f"cannot write checkpoint {final}: {error.strerror or error}") from None
    barrier()


def save_agent(path: Path, cfg: DictConfig, agent: torch.nn.Module) -> Path:
    """Write ``agent``'s weights with what rebuilds it; the rename makes the write atomic."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "recipe": cfg.recipe,
        "env_id": cfg.env.id,
        "env": OmegaConf.to_container(cfg.env),
        "algo": OmegaConf.to_container(cfg.algo),
        "agent": {key: value.cpu() for key, value in agent.state_dict().items()},
    }
    partial = path.with_suffix(".partial")
    torch.save(state, partial)
    partial.replace(path)
    return path


def locate(path: str) -> Path:
    """A checkpoint file, a training checkpoint folder (``checkpoints/frames-<N>``), or a
    run directory: its ``checkpoints/final.pt``, else (a run that never finished) its
    newest training checkpoint."""
    candidate = Path(path)
    if (candidate / META).is_file():
        return candidate
    if candidate.is_dir():
        if not (candidate / FINAL).is_file() and complete(candidate):
            return latest(candidate)
        candidate = candidate / FINAL
    if not candidate.is_file():
        raise ConfigError(f"no checkpoint at {candidate}")
    return candidate


def run_dir_of(checkpoint: Path) -> Path:
    return checkpoint.parent.parent if checkpoint.parent.name == FINAL.parent.name else checkpoint.parent


# What reading a file that is no saved agent raises: torch.load's unpickler trips on a text
# file with a KeyError or an IndexError (LookupErrors), on others with its own errors.
UNREADABLE = (OSError, EOFError, pickle.UnpicklingError, RuntimeError, LookupError, TypeError, ValueError)


def load(checkpoint: Path) -> tuple[dict[str, Any], ModuleType]:
    """The saved state (as ``save_agent`` writes it) and its recipe module."""
    try:
        if checkpoint.is_dir():
            state = agent_state(checkpoint)
        else:
            state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        name = state["recipe"]
    except UNREADABLE as err:
        kind = type(err).__name__
        raise ConfigError(
            f"cannot read checkpoint {checkpoint} ({kind}): not an agent train.py saved"
        ) from None
    try:
        return state, recipes.load(name)
    except ValueError as error:
        raise ConfigError(f"checkpoint {checkpoint}: {error}") from None


def agent_state(folder: Path) -> dict[str, Any]:
    """A training checkpoint in ``save_agent``'s form: the hyperparameters come from the
    ``config.yaml`` its run wrote."""
    meta = Meta.read(folder)
    run_config = OmegaConf.load(run_dir_of(folder) / "config.yaml")
    weights = torch.load(folder / AGENT, map_location="cpu", weights_only=True)["agent"]
    algo, env = OmegaConf.to_container(run_config.algo), OmegaConf.to_container(run_config.env)
    return {"recipe": meta.recipe, "env_id": meta.env_id, "env": env, "algo": algo, "agent": weights}


def training_dir(run_dir: str | Path, frames: int) -> Path:
    """Where the checkpoint at ``frames`` goes; zero-padded, so names sort by frame."""
    return Path(run_dir) / FINAL.parent / f"{PREFIX}{frames:012d}"


def partial_dir(final: Path) -> Path:
    """Where the checkpoint ``final`` is written, until it is complete."""
    return final.with_name(f".{final.name}.partial")


def commit(partial: Path, final: Path, keep: int) -> None:
    """Make a fully written checkpoint visible (one rename), then keep the newest ``keep``.
    A checkpoint at the same frame count gives way: a resumed run stopped (SIGINT, SIGTERM)
    before its first step writes its checkpoint again."""
    if final.exists():
        shutil.rmtree(final)
    partial.replace(final)
    for old in sorted(final.parent.glob(f"{PREFIX}*"))[:-keep]:
        shutil.rmtree(old)


def complete(run_dir: str | Path) -> list[Path]:
    """The run directory's complete training checkpoints (``meta.json`` is written last),
    oldest first."""
    return [meta.parent for meta in sorted((Path(run_dir) / FINAL.parent).glob(f"{PREFIX}*/{META}"))]


def damage(folder: Path) -> str | None:
    """What is wrong with the checkpoint ``folder``, in words; None when it is whole: its
    meta.json reads, and every file it lists is there with the size it was written with."""
    try:
        meta = Meta.read(folder)
    except (OSError, ValueError, TypeError) as error:  # unreadable, not JSON, not a Meta
        return f"{META} cannot be read ({type(error).__name__})"
    for name, size in meta.files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} when written"
    return None


def newest_whole(run_dir: str | Path) -> Path | None:
    """The run directory's newest complete checkpoint that is whole. Each damaged one on
    the way is skipped with one line saying why (once, from the launcher's rank 0)."""
    for folder in reversed(complete(run_dir)):
        reason = damage(folder)
        if reason is None:
            return folder
        if logs.launcher_rank() == 0:
            log.warning("resume: skipping %s: %s", folder, reason)
    return None


def latest(path: str | Path) -> Path:
    """A training checkpoint folder, or the newest whole one in a run directory."""
    candidate = Path(path)
    if (candidate / META).is_file():
        reason = damage(candidate)
        if reason is not None:
            raise ConfigError(f"resume: checkpoint {candidate} is damaged: {reason}")
        return candidate
    found = newest_whole(candidate)
    if found is None:
        raise ConfigError(
            f"resume: no checkpoint at {candidate} (checkpoint.every=N, and a stop by a signal, write them)"
        )
    return found


AUTO = "auto"
RECORD = "config.yaml"  # the resolved config a run writes into its run_dir as it starts
# The keys that make a run that run: what the agent learns, from which experience. A run
# going on in its run_dir may change any other (total_frames to extend it, eval, logging,
# the numbers of learners and replay processes, timeouts).
SAME_RUN = (
    "recipe",
    "env.id",
    "env.kwargs",
    "env.clip_rewards",
    "env.life_loss",
    "env.frame_stack",
    "seed",
    "algo",
    "collector.frames_per_batch",
)


def other_run(cfg: DictConfig) -> list[str]:
    """How the run whose records ``cfg.run_dir`` holds differs from ``cfg`` in the keys of
    ``SAME_RUN``, e.g. ``["seed 0 -> 1"]``; empty when they agree or there are no records."""
    record = Path(cfg.run_dir) / RECORD
    if not record.is_file():
        return []
    try:
        saved = OmegaConf.load(record)
    except (OSError, ValueError, yaml.YAMLError, OmegaConfBaseException) as error:
        return [f"its {RECORD} cannot be read ({type(error).__name__})"]
    before, now = same_run_keys(saved), same_run_keys(cfg)
    return [
        f"{key} {before.get(key, '(none)')} -> {now.get(key, '(none)')}"
        for key in sorted((before.keys() | now.keys()) - following(cfg.recipe))
        if before.get(key) != now.get(key)
    ]


def following(name: str) -> set[str]:
    """The ``algo`` keys whose recipe defaults follow another key (``"${total_frames}"``):
    they change with it, as when a resume extends a run."""
    recipe = recipes.load(name)
    layers = [recipe.RUN_DEFAULTS, *getattr(recipe, "FAMILY_DEFAULTS", {}).values()]
    return {
        f"algo.{key}"
        for layer in layers
        for key, value in layer.get("algo", {}).items()
        if isinstance(value, str) and "${" in value
    }


def same_run_keys(cfg: DictConfig) -> dict[str, Any]:
    """The values of the keys of ``SAME_RUN``; the recipe's hyperparameters one by one."""
    found = {}
    for key in SAME_RUN:
        value = OmegaConf.select(cfg, key)
        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value)
        if key == "algo" and isinstance(value, dict):
            found.update({f"algo.{name}": item for name, item in value.items()})
        else:
            found[key] = value
    return found


def check_run_dir(cfg: DictConfig, resumed: Checkpoint | None) -> None:
    """A run_dir holds one run. A run refuses one whose records (``config.yaml``) are of
    another configuration (``SAME_RUN``), whatever ``resume`` says.

    The checkpoints in a run_dir are that run's line of history: it may hold some only
    when this run goes on (``resumed``, as ``check_resume`` found it) from the newest of
    them, or the newest is damaged (``resume=auto`` always does). Otherwise two runs'
    checkpoints would mix, and a later ``resume=auto`` could go on from the other run's
    newest: a fresh start in a used run_dir, or a resume from an older checkpoint."""
    found = complete(cfg.run_dir)
    differences = other_run(cfg)
    if differences:
        branch = f", or resume={cfg.run_dir} run_dir=<another> to go on from its checkpoint" if found else ""
        raise ConfigError(
            f"run_dir {cfg.run_dir} holds another run's records: {', '.join(differences)} (a run keeps "
            f"its recipe, env, seed, algo and frames_per_batch; total_frames, eval, learners and the rest "
            f"may change): choose another run_dir{branch}"
        )
    if not found or cfg.resume == AUTO:
        return
    newest = found[-1]
    going_on = resumed is not None and (resumed.folder.resolve() == newest.resolve() or damage(newest))
    if not going_on:
        raise ConfigError(
            f"run_dir {cfg.run_dir} holds checkpoints up to {newest.name}, which this run would not go "
            f"on from: resume={cfg.run_dir} goes on from them; or choose another run_dir"
        )


def check_resume(cfg: DictConfig) -> Checkpoint | None:
    """The checkpoint ``cfg.resume`` points at, if this run can go on from it; any layout
    of learners and replay shards resumes.

    ``resume=auto``: the newest complete checkpoint in ``run_dir``, or None (start afresh)
    when there is none yet, so a job requeued by SLURM runs the same command.
    """
    if cfg.resume is None:
        return None
    folder = newest_whole(cfg.run_dir) if cfg.resume == AUTO else latest(cfg.resume)
    if folder is None:  # resume=auto, and no whole checkpoint yet
        return None
    meta = Meta.read(folder)
    if (meta.recipe, meta.env_id) != (cfg.recipe, cfg.env.id):
        raise ConfigError(
            f"resume: {folder} is a checkpoint of recipe '{meta.recipe}' on {meta.env_id}, "
            f"not of '{cfg.recipe}' on {cfg.env.id}"
        )
    if meta.frames_per_batch != cfg.collector.frames_per_batch:
        raise ConfigError(
            f"resume: {folder} was written with frames_per_batch={meta.frames_per_batch}, "
            f"this run has {cfg.collector.frames_per_batch}"
        )
    return Checkpoint(**dataclasses.asdict(meta), folder=folder)


def restore_learner(
    folder: Path,
    index: int,
    agent: torch.nn.Module,
    optimizers: dict[str, torch.optim.Optimizer],
    device: torch.device,
    fresh_seed: int = 0,
) -> None:
    """Put learner ``index`` back as it was when ``folder`` was written.

    Everything is read onto the CPU: ``load_state_dict`` copies the weights onto the agent's
    device, and each optimizer moves its state next to each parameter, all but what torch
    keeps on the CPU on purpose (Adam's ``step`` unless fused or ``capturable``), which a load
    straight onto the GPU would put there. A learner the checkpoint's run did not have
    (it had fewer) seeds its random generators with ``fresh_seed``.
    """
    state = torch.load(folder / AGENT, map_location="cpu", weights_only=True)
    agent.load_state_dict(state["agent"])
    for name, optimizer in optimizers.items():
        optimizer.load_state_dict(state["optimizers"][name])
    rng = folder / f"rng-{index}.pt"
    if rng.is_file():
        # The run's own file, written by rng_state: numpy's state is not a tensor.
        set_rng_state(torch.load(rng, weights_only=False))
    else:
        seed_everything(fresh_seed, verbose=False)


def rng_state() -> dict[str, Any]:
    """This process's random generators; with CUDA, the current GPU's too (Fabric makes a
    rank's own GPU current; asking for every GPU's would open a context on each)."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
