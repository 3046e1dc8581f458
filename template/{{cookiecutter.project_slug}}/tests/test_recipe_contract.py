"""The recipe contract: a recipe that breaks it is refused when it loads, in one line naming
what is missing, and one whose update breaks a rule before it trains, in one line naming
the rule (docs/adding-a-recipe.md has the contract)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }} import config, recipes, train

from .conftest import PROJECT, RECIPES, fabric_command, free_port

# The least a replay recipe must define: every name and member the runtime uses.
SKELETON = """
from dataclasses import dataclass

from torch import nn

RUN_DEFAULTS = {"env": {"id": "CartPole-v1", "num_envs": 2}, "collector": {"frames_per_batch": 2}}


@dataclass
class Config:
    batch_size: int = 2
    updates_per_batch: int = 1
    learning_starts: int = 0


class Agent(nn.Module):
    uses_replay = True
    action_spaces = ("discrete",)
    batch_keys = ("observation", "action")

    @property
    def policy(self):
        return None

    def make_optimizers(self):
        return {}

    def after_collect(self, batch, frames, sum_over_learners):
        pass

    def forward(self, batch):
        return None

    def optimizer_step(self, optimizers, update):
        pass
"""

BROKEN = [
    ("RUN_DEFAULTS = ", "DEFAULTS = ", "defines no RUN_DEFAULTS"),
    ("@dataclass\nclass Config:", "class Config:", "Config is not a dataclass"),
    ("class Agent(nn.Module):", "class Agent:", "Agent is not an nn.Module"),
    ("    def optimizer_step(", "    def step(", "Agent has no optimizer_step"),
    ("    def forward(", "    def loss(", "Agent has no forward"),
    ("    def policy(", "    def actor(", "Agent has no policy"),
    ("    action_spaces = ", "    spaces = ", "Agent has no action_spaces"),
    ('("discrete",)', '("pixels",)', "Agent.action_spaces must name 'discrete', 'continuous' or both"),
    ("    batch_keys = ", "    keys = ", "Agent uses replay but has no batch_keys"),
    ("    batch_keys = ", "    update_path = True\n    batch_keys = ", "Agent.update_path must be a method"),
    (
        "    learning_starts: int = 0\n",
        "",
        "Config has no learning_starts, which learner.off_policy reads",
    ),
    (
        "    uses_replay = True",
        "    uses_replay = False",
        "Config has no epochs, which learner.on_policy reads",
    ),
]


def module_of(source: str) -> types.ModuleType:
    """``source`` as a module, as importing a recipe file makes one (dataclasses look their
    module up while they are made)."""
    module = types.ModuleType("recipe_under_test")
    sys.modules[module.__name__] = module
    try:
        exec(compile(source, "recipe_under_test.py", "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    return module


def test_a_recipe_with_every_member_loads():
    recipes.check("skeleton", module_of(SKELETON))


@pytest.mark.parametrize(("old", "new", "missing"), BROKEN, ids=[case[2].split(",")[0] for case in BROKEN])
def test_a_broken_recipe_is_refused_in_one_line_naming_what_is_missing(old, new, missing):
    assert old in SKELETON
    with pytest.raises(recipes.RecipeError) as refused:
        recipes.check("broken", module_of(SKELETON.replace(old, new)))
    message = str(refused.value)
    assert message.startswith(f"recipe broken: {missing}") and message.endswith(
        "(see docs/adding-a-recipe.md)"
    )
    assert "\n" not in message


# A replay recipe that trains: a linear Q function regressed on the reward. Each mistake
# below breaks one rule of an update; check_update finds it before a run trains.
LINEAR_Q = """
from dataclasses import dataclass

import torch
from torch import nn
from torchrl.modules import QValueActor

RUN_DEFAULTS = {
    "env": {"id": "CartPole-v1", "num_envs": 4},
    "collector": {"frames_per_batch": 64},
    "total_frames": 512,
}


@dataclass
class Config:
    batch_size: int = 32
    updates_per_batch: int = 1
    learning_starts: int = 64


class Agent(nn.Module):
    uses_replay = True
    action_spaces = ("discrete",)
    batch_keys = ("observation", "action", ("next", "reward"))

    def __init__(self, cfg, env):
        super().__init__()
        self.action_spec = env.action_spec
        self.q = nn.Linear(env.observation_spec["observation"].shape[-1], env.action_spec.shape[-1])

    @property
    def policy(self):
        return QValueActor(self.q, in_keys=["observation"], spec=self.action_spec)

    def make_optimizers(self):
        return {"sgd": torch.optim.SGD(self.q.parameters(), lr=0.01)}

    def after_collect(self, batch, frames, sum_over_learners):
        pass

    def forward(self, batch):
        q = (self.q(batch["observation"]) * batch["action"]).sum(-1)
        errors = (q - batch["next", "reward"].squeeze(-1)).pow(2)
        loss = (errors * batch["priority_weight"]).mean()
        return loss, errors.detach(), {"q": q.mean().detach()}

    def optimizer_step(self, optimizers, update):
        optimizers["sgd"].step()
"""
# name -> (what LINEAR_Q says, what the mistake says instead, the rule refused). The check
# collects 2 steps of 2 CartPoles: a batch of 4 transitions.
MISTAKES = {
    "float_priorities": (
        "errors.detach(), {",
        "errors.mean().item(), {",
        "forward's priorities must be a tensor of shape [4], one per replay item, got a float",
    ),
    "scalar_priorities": (
        "errors.detach(), {",
        "errors.mean().detach(), {",
        "forward's priorities must be a tensor of shape [4], one per replay item, got shape []",
    ),
    "column_priorities": (
        "errors.detach(), {",
        "errors.detach().unsqueeze(-1), {",
        "forward's priorities must be a tensor of shape [4], one per replay item, got shape [4, 1]",
    ),
    "loss_per_transition": (
        'batch["priority_weight"]).mean()',
        'batch["priority_weight"])',
        "forward's loss must be a scalar tensor, got shape [4]",
    ),
    "metric_per_transition": (
        '{"q": q.mean().detach()}',
        '{"q": q.detach()}',
        "forward's metric 'q' must be a scalar tensor, got shape [4]",
    ),
    "no_step": (
        'optimizers["sgd"].step()',
        "pass",
        "optimizer_step moved no parameter at update 1: it must step the optimizers",
    ),
}
CARTPOLES = {"id": "CartPole-v1", "num_envs": 4}


def mistaken(name: str) -> str:
    old, new, _ = MISTAKES[name]
    assert LINEAR_Q.count(old) == 1
    return LINEAR_Q.replace(old, new)


def refusal(name: str) -> str:
    return f"error: recipe {name}: {MISTAKES[name][2]} (see docs/adding-a-recipe.md)"


@pytest.mark.parametrize("name", RECIPES)
def test_each_recipe_makes_a_sound_update_and_leaves_the_random_state_alone(name):
    cfg = config.load([f"recipe={name}"], train.DEFAULTS)
    state = torch.get_rng_state()
    recipes.check_update(name, recipes.load(name), cfg.algo, cfg.env, cfg.seed)
    assert torch.equal(torch.get_rng_state(), state)


def test_a_recipe_whose_update_keeps_the_rules_passes():
    recipes.check_update("linear_q", module_of(LINEAR_Q), {}, CARTPOLES, seed=0)


@pytest.mark.parametrize("name", MISTAKES)
def test_an_update_that_breaks_a_rule_is_refused_in_one_line_naming_it(name):
    with pytest.raises(recipes.RecipeError) as refused:
        recipes.check_update(name, module_of(mistaken(name)), {}, CARTPOLES, seed=0)
    assert f"error: {refused.value}" == refusal(name)


def test_a_recipe_whose_update_raises_is_refused_in_one_line_naming_the_error():
    raising = LINEAR_Q.replace('batch["next", "reward"].squeeze(-1)', 'batch["next", "rewards"].squeeze(-1)')
    with pytest.raises(recipes.RecipeError) as refused:
        recipes.check_update("raising", module_of(raising), {}, CARTPOLES, seed=0)
    line = str(refused.value)
    assert line.startswith("recipe raising: its first update raised KeyError: ") and "\n" not in line
    assert line.endswith("see docs/adding-a-recipe.md)")


@pytest.fixture(scope="module")
def mistakes_project(tmp_path_factory):
    """A copy of the project with each mistake as a recipe file of its own."""
    project = tmp_path_factory.mktemp("mistakes") / "project"
    not_the_project = shutil.ignore_patterns("runs", "__pycache__", ".*", "*.egg-info")
    shutil.copytree(PROJECT, project, ignore=not_the_project)
    recipes_folder = next(project.glob("*/recipes"))
    for name in MISTAKES:
        (recipes_folder / f"{name}.py").write_text(mistaken(name))
    return project


def run_in(project: Path, command: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(project)}
    return subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=300)


# Each mistake's line is checked above, in this process: train.py says whichever line
# check_update raises the same way (one process costs 8 to 10 s of start-up on 2 cores).
def test_fabrics_own_launcher_refuses_a_mistake_before_it_starts_a_rank(mistakes_project, tmp_path):
    """`python train.py fabric.devices=2`: the check runs in the process that would launch
    the ranks, says its line, exits 2 and writes nothing."""
    command = [sys.executable, "train.py", "recipe=no_step", "fabric.devices=2", "fabric.accelerator=cpu"]
    result = run_in(mistakes_project, [*command, f"run_dir={tmp_path}"])
    assert (result.returncode, result.stdout, result.stderr) == (2, "", refusal("no_step") + "\n")
    assert not any(tmp_path.iterdir())


def torchrun(*arguments: str) -> list[str]:
    launcher = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    return [launcher, "--nproc-per-node=2", f"--master-port={free_port()}", *arguments]


# Every mistake takes the same way out under a launcher (check_update's RecipeError, which
# rank 0 says), and so does a bad setting (config's ConfigError: train.main refuses both in
# one place). One under each launcher: a launch costs 20 to 30 s on 2 cores.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("launcher", "name"), [("fabric run", "float_priorities"), ("torchrun", "loss_per_transition")]
)
def test_under_torchelastic_rank_0_says_the_one_line_and_the_launcher_reports_its_exit(
    mistakes_project, tmp_path, launcher, name
):
    """`fabric run` and torchrun start the ranks before any code of the project runs: rank 0
    says the line and exits 2, the other ranks say nothing. The launcher then reports the
    failed rank itself, a ChildFailedError traceback and exit code 1, which no rank can
    change (docs/adding-a-recipe.md)."""
    arguments = ["train.py", f"recipe={name}", f"run_dir={tmp_path}"]
    command = fabric_command(2, *arguments) if launcher == "fabric run" else torchrun(*arguments)
    result = run_in(mistakes_project, command)
    assert result.returncode == 1 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert [line for line in lines if line.startswith("error: ")] == [refusal(name)], result.stderr[-3000:]
    # The one traceback is the launcher's, after the line.
    assert result.stderr.count("Traceback") == 1
    assert result.stderr.index(refusal(name)) < result.stderr.index("Traceback")
    report = result.stderr[result.stderr.index("ChildFailedError") :]
    assert "rank      : 0 (local_rank: 0)\n  exitcode  : 2" in report, report
    assert not any(tmp_path.iterdir())
