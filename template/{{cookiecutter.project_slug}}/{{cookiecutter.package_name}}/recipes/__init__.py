"""Recipes: one module per algorithm, found by name (``recipe=x`` loads ``recipes/x.py``).

A recipe module holds what is specific to its algorithm. From this package it imports
only, by name, the networks and helpers that several recipes share, in ``_parts.py``
(which every project has and which names no recipe), so it can be read, linted and
tested on its own, and a project keeps only the recipes it was made with. It defines:

``RUN_DEFAULTS``
    The run settings this algorithm comes with (``env.id``, ``env.num_envs``,
    ``collector.frames_per_batch``, ``total_frames``, and ``algo`` values that depend on
    them, such as ``"${total_frames}"``); config.yaml and the command line override them.
``FAMILY_DEFAULTS`` (optional)
    Run settings and ``algo`` values for env families (``"atari"``, ``"minatar"``,
    ``"mujoco"``; see ``envs.py``), merged over ``RUN_DEFAULTS`` when ``env.id`` is of
    that family: the standard setups, such as DQN's on Atari.
``Config``
    A dataclass of hyperparameters with defaults, mounted at ``algo`` in the run config.
    The learner's loop reads ``CONFIG_FIELDS`` from it.
``Agent(cfg, env)``
    An ``nn.Module`` holding every trained parameter, with the members of ``AgentProtocol``
    below (and ``batch_keys`` in a replay recipe). An Agent whose ``forward`` computes
    something else at some updates (TD3: the actor's loss every ``policy_delay`` updates)
    has an ``update_path(update)`` method, which the learner calls before each update with
    its number (from 1): it sets what ``forward`` follows and names the path, any hashable
    value. ``cudagraphs=true`` records a CUDA graph per path and would otherwise replay the
    first one at every update.
    An on-policy Agent whose ``forward`` reads whole env-copy sequences (an LSTM's) says so
    in a ``recurrent`` attribute: its minibatches are then ``[copies, steps]``, in time order.
    A replay Agent whose items are not single transitions (R2D2's sequences) makes them in
    a ``replay_items(batch)`` method from each collector batch ``[copies, steps]``, says
    how many steps ``check_update`` must collect for one in ``sequence_length``, and may
    say how many steps a copy's sequence shares with the one before in
    ``sequence_overlap`` (replay stores those once for pixels).

``load`` checks all of this when a recipe loads and names what is missing in one line;
``check_update`` then makes one update of a fresh Agent on a few transitions before a run
trains, and names the first rule its results break. docs/adding-a-recipe.md explains
each part and adds a recipe step by step.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import traceback
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import torch
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torchrl.envs import EnvBase
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import GRUModule, LSTMModule

from ..envs import CONTINUOUS, DISCRETE, TrainingBatches, make_env, with_recurrent_state

# The hyperparameters the learner's loops read, by Agent.uses_replay.
CONFIG_FIELDS = {
    True: ("batch_size", "updates_per_batch", "learning_starts"),
    False: ("epochs", "minibatch_size"),
}
GUIDE = "docs/adding-a-recipe.md"
# check_update's batch: CHECK_STEPS steps of up to CHECK_COPIES copies of the run's env.
# Fewer copies than the run's: 8 Atari games take seconds to start, 2 a fraction of that.
CHECK_COPIES, CHECK_STEPS = 2, 2


class AgentProtocol(Protocol):
    """What the runtime uses of a recipe's ``Agent``, besides being an ``nn.Module``."""

    uses_replay: bool
    """True: the learners sample from replay; False: each trains on what it just collected"""
    action_spaces: tuple[str, ...]
    """the env action spaces this recipe fits: DISCRETE, CONTINUOUS or both"""

    @property
    def policy(self) -> TensorDictModuleBase:
        """What the collector acts with (it shares the agent's parameters)."""

    def make_optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """The named optimizers over the agent's parameters (checkpoints keep each by name)."""

    def after_collect(
        self, batch: TensorDictBase, frames: int, sum_over_learners: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """Per-batch work on this learner's batch, ``frames`` being all learners': exploration
        annealing, or advantages written into ``batch``. ``sum_over_learners(tensor)`` sums a
        tensor over the learners, for statistics that must be the same on every learner."""

    def forward(
        self, batch: TensorDictBase
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        """``(loss, priorities, metrics)`` for a batch: priorities per transition in a replay
        recipe (None in an on-policy one), and scalar tensors to log."""

    def optimizer_step(self, optimizers: dict[str, torch.optim.Optimizer], update: int) -> None:
        """What happens after backward, at update ``update`` (from 1): which optimizers
        step, gradient clipping, target networks."""


# Every member the protocol declares: its annotated attributes and its methods.
AGENT_MEMBERS = (
    *AgentProtocol.__annotations__,
    *(name for name in vars(AgentProtocol) if not name.startswith("_")),
)


class RecipeError(ValueError):
    """A recipe that does not follow the contract above, in one line."""


def available() -> list[str]:
    return sorted(info.name for info in pkgutil.iter_modules(__path__) if not info.name.startswith("_"))


def load(name: str) -> ModuleType:
    """The recipe module ``name``, checked against the contract."""
    if name not in available():
        raise RecipeError(f"unknown recipe '{name}' (available: {', '.join(available())})")
    module = importlib.import_module(f"{__name__}.{name}")
    check(name, module)
    return module


def check(name: str, module: ModuleType) -> None:
    """Raise RecipeError naming the first thing ``module`` lacks."""

    def broken(what: str) -> RecipeError:
        return RecipeError(f"recipe {name}: {what} (see {GUIDE})")

    for required in ("RUN_DEFAULTS", "Config", "Agent"):
        if not hasattr(module, required):
            raise broken(f"defines no {required}")
    if not dataclasses.is_dataclass(module.Config):
        raise broken("Config is not a dataclass")
    agent = module.Agent
    if not (isinstance(agent, type) and issubclass(agent, torch.nn.Module)):
        raise broken("Agent is not an nn.Module")
    for member in AGENT_MEMBERS:
        # nn.Module's own forward raises: a recipe must define its own.
        if getattr(agent, member, None) is getattr(torch.nn.Module, member, None):
            raise broken(f"Agent has no {member}")
    if not agent.action_spaces or set(agent.action_spaces) - {DISCRETE, CONTINUOUS}:
        raise broken(f"Agent.action_spaces must name {DISCRETE!r}, {CONTINUOUS!r} or both")
    if agent.uses_replay and not hasattr(agent, "batch_keys"):
        raise broken("Agent uses replay but has no batch_keys")
    if hasattr(agent, "update_path") and not callable(agent.update_path):
        raise broken("Agent.update_path must be a method, update_path(update), that names the update's path")
    fields = {field.name for field in dataclasses.fields(module.Config)}
    missing = [field for field in CONFIG_FIELDS[bool(agent.uses_replay)] if field not in fields]
    if missing:
        loop = "off_policy" if agent.uses_replay else "on_policy"
        raise broken(f"Config has no {missing[0]}, which learner.{loop} reads")


def check_update(
    name: str, recipe: ModuleType, algo: Any, env: Mapping[str, Any], seed: int
) -> torch.nn.Module:
    """The Agent that made one update of ``recipe`` before a run trains (``update_once``);
    RecipeError naming the first rule that update breaks, or, where the recipe's own code
    raises, the error and the line of the recipe it came from, in one line as well."""
    try:
        return update_once(name, recipe, algo, env, seed)
    except RecipeError:
        raise
    except Exception as error:
        here = Path(__file__)
        in_recipe = [
            frame
            for frame in traceback.extract_tb(error.__traceback__)
            if Path(frame.filename).parent == here.parent and Path(frame.filename) != here
        ]
        where = f"{Path(in_recipe[-1].filename).name}, line {in_recipe[-1].lineno}; " if in_recipe else ""
        message = (str(error).splitlines() or [""])[0]
        raise RecipeError(
            f"recipe {name}: its first update raised {type(error).__name__}: {message} ({where}see {GUIDE})"
        ) from error


def update_once(
    name: str, recipe: ModuleType, algo: Any, env: Mapping[str, Any], seed: int
) -> torch.nn.Module:
    """A fresh Agent's ``forward``, backward and ``optimizer_step`` at update 1 on a few
    transitions it collected (``first_batch``), each checked against the contract; the
    Agent. The run's own agent is built apart, from its seed, and torch's random state is
    left as it was."""

    def broken(what: str) -> RecipeError:
        return RecipeError(f"recipe {name}: {what} (see {GUIDE})")

    env = OmegaConf.to_container(env) if isinstance(env, DictConfig) else env
    with torch.random.fork_rng(devices=[]):
        copies = make_env(env, min(env["num_envs"], CHECK_COPIES), seed)
        try:
            agent = recipe.Agent(config_of(recipe, algo), copies)
            batch = first_batch(agent, copies, env)
        finally:
            copies.close()
        optimizers = agent.make_optimizers()
        trained = [parameter for parameter in agent.parameters() if parameter.requires_grad]
        before = [parameter.detach().clone() for parameter in trained]
        update_path(agent, 1)
        returned = agent(batch)
        if not (isinstance(returned, tuple) and len(returned) == 3):
            raise broken(f"forward must return (loss, priorities, metrics), got {described(returned)}")
        loss, priorities, metrics = returned
        if not (isinstance(loss, torch.Tensor) and loss.ndim == 0):
            raise broken(f"forward's loss must be a scalar tensor, got {described(loss)}")
        if not loss.requires_grad:
            raise broken("forward's loss has no gradient (computed under no_grad, or detached)")
        one_each = isinstance(priorities, torch.Tensor) and priorities.shape == batch.shape
        if agent.uses_replay and not one_each:
            raise broken(
                f"forward's priorities must be a tensor of shape [{len(batch)}], one per replay item, "
                f"got {described(priorities)}"
            )
        if not agent.uses_replay and priorities is not None:
            raise broken(f"an on-policy recipe's priorities must be None, got {described(priorities)}")
        if not isinstance(metrics, Mapping):
            raise broken(f"forward's metrics must be a dict of scalar tensors, got {described(metrics)}")
        for key, value in metrics.items():
            if not (isinstance(value, torch.Tensor) and value.ndim == 0):
                raise broken(f"forward's metric {key!r} must be a scalar tensor, got {described(value)}")
        loss.backward()
        agent.optimizer_step(optimizers, 1)
        if all(torch.equal(old, parameter) for old, parameter in zip(before, trained, strict=True)):
            raise broken("optimizer_step moved no parameter at update 1: it must step the optimizers")
    return agent


def first_batch(agent: torch.nn.Module, copies: EnvBase, env: Mapping[str, Any]) -> TensorDictBase:
    """What ``agent``'s first update trains on, in small: ``CHECK_STEPS`` steps of the env
    ``copies`` (made from the run's ``env`` config; a sequence's worth for an agent with a
    ``sequence_length``) as a collector takes them with its policy, after
    ``after_collect``; as replay samples them (``replay_items``, ``priority_weight``), or as
    an on-policy minibatch."""
    copies = with_recurrent_state(copies, agent.policy)
    steps = max(CHECK_STEPS, getattr(agent, "sequence_length", 0))
    with torch.no_grad(), set_exploration_type(ExplorationType.RANDOM):
        batch = copies.rollout(steps, agent.policy, break_when_any_done=False)
    batch = TrainingBatches(env.get("clip_rewards", False), env.get("life_loss", False))(batch)
    agent.after_collect(batch, batch.numel(), lambda tensor: tensor)
    if not agent.uses_replay:
        return batch if recurrent(agent) else batch.reshape(-1)
    batch = replay_items(agent, batch).reshape(-1)
    batch["priority_weight"] = torch.ones(batch.shape)
    return batch


def replay_items(agent: torch.nn.Module, batch: TensorDictBase) -> TensorDictBase:
    """What a replay ``agent``'s learner writes to replay of a collector batch ``[copies,
    steps]``: the items its optional ``replay_items`` method makes (R2D2's sequences,
    ``[copies, sequences]``), or each step's ``batch_keys`` (transitions)."""
    make = getattr(agent, "replay_items", None)
    return make(batch) if make is not None else batch.select(*agent.batch_keys)


def sequence_overlap(agent: torch.nn.Module) -> int:
    """The steps a sequence recipe's item shares with the one before from the same env
    copy (its optional ``sequence_overlap``), which replay stores once for pixels."""
    return getattr(agent, "sequence_overlap", 0)


def update_path(agent: torch.nn.Module, update: int) -> Hashable:
    """The path of ``forward`` that ``agent``'s update ``update`` takes, set up for it (its
    optional ``update_path`` method); None for an Agent whose updates all take one."""
    method = getattr(agent, "update_path", None)
    return method(update) if method is not None else None


def recurrent(agent: torch.nn.Module) -> bool:
    """Whether an on-policy ``agent`` trains on whole env-copy sequences (its optional
    ``recurrent`` attribute) rather than on single frames."""
    return bool(getattr(agent, "recurrent", False))


def described(value: Any) -> str:
    """``value`` in an error line: a tensor by its shape, anything else by its type."""
    if isinstance(value, torch.Tensor):
        return f"shape [{', '.join(map(str, value.shape))}]"
    return "None" if value is None else f"a {type(value).__name__}"


def config_of(recipe: ModuleType, algo: Any) -> Any:
    """``recipe``'s Config from ``algo``: one already, or a mapping of its fields (a run
    config's ``algo``)."""
    if isinstance(algo, recipe.Config):
        return algo
    return recipe.Config(**(OmegaConf.to_container(algo) if isinstance(algo, DictConfig) else algo))


def check_graphable(name: str, agent: torch.nn.Module) -> None:
    """Raise RecipeError where a CUDA graph cannot hold ``agent``'s update
    (``cudagraphs=true``). torchrl's recurrent modules split each sequence at its episode
    starts into pieces whose number and lengths depend on the batch, which they read on
    the CPU: a graph records fixed shapes and no reads back."""
    if any(isinstance(module, (LSTMModule, GRUModule)) for module in agent.modules()):
        raise RecipeError(
            f"recipe {name}: cudagraphs=true cannot record its recurrent update "
            "(torchrl's LSTM splits sequences at episode starts, by the batch); run it without"
        )


def make_agent(
    recipe: ModuleType, algo: Any, env: Mapping[str, Any] | str, num_envs: int = 1
) -> torch.nn.Module:
    """``recipe``'s Agent with hyperparameters ``algo`` (its Config, or a mapping of the
    Config's fields such as a run config's ``algo``), its layers sized by a batch of
    ``num_envs`` copies of ``env``."""
    spec_env = make_env(env, num_envs, seed=0)
    try:
        return recipe.Agent(config_of(recipe, algo), spec_env)
    finally:
        spec_env.close()
