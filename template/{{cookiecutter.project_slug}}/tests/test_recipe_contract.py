"""The recipe contract: a recipe that breaks it is refused when it loads, in one line naming
what is missing (docs/adding-a-recipe.md has the contract)."""

from __future__ import annotations

import sys
import types

import pytest

from {{ cookiecutter.package_name }} import recipes

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
