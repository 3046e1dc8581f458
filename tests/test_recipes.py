"""Recipes tested in place, as the plain Python files the template writes into projects."""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
import sys
from types import ModuleType

import gymnasium as gym
import pytest
import torch
from torchrl.envs import GymWrapper
from torchrl.modules import get_env_transforms_from_module, get_primers_from_module

from .conftest import REPO

SOURCE = REPO / "template" / "{{cookiecutter.project_slug}}" / "{{cookiecutter.package_name}}" / "recipes"
RECIPES = sorted(p.stem for p in SOURCE.glob("*.py") if not p.stem.startswith("_"))


# The package the recipe files run in, standing in for the project's `recipes` package.
PACKAGE = "template_recipes"


@functools.cache
def load(name: str) -> ModuleType:
    """The recipe file ``name`` as a module of a stand-in package: a recipe imports nothing
    from the project's package but its shared parts (``from ._parts import ...``), and the
    package's ``recipes/__init__.py`` (relative imports) cannot be imported from the
    template. Run from its source, as an import would leave a ``__pycache__`` in the
    template for cookiecutter to copy into projects."""
    if name != "_parts":
        load("_parts")  # first: a recipe's `from ._parts import ...` finds it loaded
    sys.modules.setdefault(PACKAGE, ModuleType(PACKAGE))
    path = SOURCE / f"{name}.py"
    module = ModuleType(f"{PACKAGE}.{name}")
    module.__file__ = str(path)
    module.__package__ = PACKAGE
    sys.modules[module.__name__] = module  # dataclasses look their module up while it runs
    exec(compile(path.read_text(), path, "exec"), module.__dict__)
    return module


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_follows_the_interface_and_its_loss_trains(name):
    recipe = load(name)
    assert dataclasses.is_dataclass(recipe.Config)
    defaults = recipe.RUN_DEFAULTS
    assert {"env", "collector", "total_frames"} <= set(defaults) <= {
        "env", "collector", "total_frames", "algo", "replay"
    }  # fmt: skip
    # config.yaml sets the replay's other keys, and it sits over the run defaults.
    assert set(defaults.get("replay", {})) <= {"alpha", "batches_per_request"}
    assert defaults["collector"]["frames_per_batch"] % defaults["env"]["num_envs"] == 0
    fields = {field.name for field in dataclasses.fields(recipe.Config)}
    needed = (
        {"batch_size", "updates_per_batch", "learning_starts"}
        if recipe.Agent.uses_replay
        else {"epochs", "minibatch_size"}
    )
    assert needed <= fields

    if defaults["env"]["id"].startswith("popgym-"):  # POPGym registers its ids when imported
        gym.register_envs(pytest.importorskip("popgym"))
    env = GymWrapper(
        gym.make_vec(
            defaults["env"]["id"],
            num_envs=2,
            vectorization_mode="sync",
            vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
        )
    )
    agent = recipe.Agent(recipe.Config(), env)
    assert isinstance(agent, torch.nn.Module)
    for attribute in ("policy", "make_optimizers", "after_collect", "optimizer_step"):
        assert hasattr(agent, attribute), attribute
    assert set(recipe.Agent.action_spaces) <= {"discrete", "continuous"} and recipe.Agent.action_spaces

    # A policy with an LSTM: its state and is_init in every step, as the project's make_env adds them.
    if get_primers_from_module(agent.policy, warn=False) is not None:
        env = env.append_transform(get_env_transforms_from_module(agent.policy))
    # A recipe replaying sequences needs one sequence's steps.
    steps = max(16, getattr(agent, "sequence_length", 0))
    with torch.no_grad():  # as the runtime's collector
        batch = env.rollout(steps, agent.policy, break_when_any_done=False)  # [2 envs, steps]
    agent.after_collect(batch, batch.numel(), lambda values: values)  # one learner: its own sums
    if recipe.Agent.uses_replay:  # as replay stores and samples them: transitions, or sequences
        make_items = getattr(agent, "replay_items", None)
        batch = (make_items(batch) if make_items else batch.select(*agent.batch_keys)).reshape(-1)
        batch["priority_weight"] = torch.ones(batch.shape)
    else:
        batch = batch.reshape(-1)
    loss, priorities, metrics = agent(batch)
    assert loss.ndim == 0 and torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
    if recipe.Agent.uses_replay:
        assert priorities.shape == batch.shape and torch.isfinite(priorities).all()
    else:
        assert priorities is None
    optimizers = agent.make_optimizers()
    before = [p.detach().clone() for p in agent.parameters()]
    loss.backward()
    agent.optimizer_step(optimizers, 1)
    assert any(not torch.equal(a, b) for a, b in zip(before, agent.parameters(), strict=True))


@pytest.mark.parametrize("name", RECIPES)
def test_a_recipe_imports_only_the_shared_parts_from_the_project(name):
    """A project keeps only the recipes chosen at generation, and the shared parts: a
    recipe importing another, or the runtime, would break there or tie the two together."""
    tree = ast.parse((SOURCE / f"{name}.py").read_text())
    relative = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level]
    assert set(relative) <= {"_parts"}, relative


def test_the_shared_parts_name_no_recipe():
    """Every project has _parts.py, whichever recipes it was made with: it speaks of none."""
    text = (SOURCE / "_parts.py").read_text().lower()
    assert [name for name in RECIPES if re.search(rf"\b{name}\b", text)] == []


@pytest.mark.parametrize("name", RECIPES)
def test_every_hyperparameter_is_described_under_its_field(name):
    """`python train.py --help` shows the docstring under each field of the recipe's Config
    (the project's usage.py reads it); each one must have one."""
    source = (SOURCE / f"{name}.py").read_text()
    (config,) = [node for node in ast.parse(source).body if getattr(node, "name", None) == "Config"]
    described = {
        node.target.id
        for node, after in zip(config.body, config.body[1:], strict=False)
        if isinstance(node, ast.AnnAssign)
        and isinstance(after, ast.Expr)
        and isinstance(getattr(after.value, "value", None), str)
    }
    fields = {field.name for field in dataclasses.fields(load(name).Config)}
    assert fields == described


@pytest.mark.parametrize("name", RECIPES)
def test_family_defaults_set_known_keys_in_whole_collector_steps(name):
    recipe = load(name)
    fields = {field.name for field in dataclasses.fields(recipe.Config)}
    for family, defaults in getattr(recipe, "FAMILY_DEFAULTS", {}).items():
        assert family in {"atari", "minatar", "mujoco", "popgym"}, family
        assert set(defaults) <= {"env", "collector", "replay", "total_frames", "algo"}
        # config.yaml sets the other keys, and it sits over the family defaults: these are
        # the ones it leaves to them (???).
        assert set(defaults.get("replay", {})) <= {"alpha", "batches_per_request", "capacity"}
        assert set(defaults.get("env", {})) <= {"num_envs", "clip_rewards", "life_loss", "frame_stack"}
        assert set(defaults.get("algo", {})) <= fields
        if "collector" in defaults:
            assert defaults["collector"]["frames_per_batch"] % defaults["env"]["num_envs"] == 0


@pytest.mark.parametrize(
    ("shape", "convolutions", "features"),
    [((4, 84, 84), [32, 64, 64], 3136), ((4, 10, 10), [16], 1024), ((7,), [], 7)],
)
def test_dqn_builds_the_network_the_observations_call_for(shape, convolutions, features):
    """Atari frames: the Nature-DQN convolutions; MinAtar grids: the MinAtar network's one;
    vectors: an MLP. Images are uint8 and become floats inside the network."""
    network = load("dqn").make_q_network(torch.Size(shape), actions=6, hidden_sizes=[32])
    convs = [module.out_channels for module in network.modules() if isinstance(module, torch.nn.Conv2d)]
    linears = [module for module in network.modules() if isinstance(module, torch.nn.Linear)]
    assert convs == convolutions and linears[0].in_features == features
    dtype = torch.uint8 if len(shape) == 3 else torch.float32
    inputs = torch.randint(0, 255 if shape[-1] == 84 else 2, (5, *shape), dtype=dtype)
    assert network(inputs).shape == (5, 6)
    if len(shape) == 3:  # scaled to [0, 1] inside: full-white frames give finite, modest values
        assert network(torch.full((1, *shape), 255 if shape[-1] == 84 else 1, dtype=dtype)).abs().max() < 10
