"""Recipes: one module per algorithm, found by name (``recipe=x`` loads ``recipes/x.py``).

A recipe module holds what is specific to its algorithm and imports nothing from this
package, so it can be read, linted and tested on its own. It defines:

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
    Replay recipes need ``batch_size``, ``updates_per_batch`` and ``learning_starts``;
    on-policy recipes need ``epochs`` and ``minibatch_size``. A ``max_grad_norm`` (if
    any, and not None) clips the gradients before each optimizer step.
``Agent(cfg, env)``
    An ``nn.Module`` holding every trained parameter. The runtime wraps it in DDP, so its
    ``forward(batch)`` returns ``(loss, metrics)`` and DDP all-reduces the gradients. It has
    ``uses_replay``, ``policy`` (what the collector runs; greedy evaluation runs it in
    deterministic mode), ``make_optimizers()`` (named optimizers),
    ``optimizers_to_step(update)`` (the names that step at this update),
    ``after_collect(batch, frames)`` and ``after_update(update)``; replay recipes also
    ``batch_keys`` (the keys a replay batch needs) and ``priority_key``.

docs/adding-a-recipe.md explains each part and adds a recipe step by step.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def available() -> list[str]:
    return sorted(info.name for info in pkgutil.iter_modules(__path__) if not info.name.startswith("_"))


def load(name: str) -> ModuleType:
    if name not in available():
        raise ValueError(f"unknown recipe '{name}' (available: {', '.join(available())})")
    return importlib.import_module(f"{__name__}.{name}")
