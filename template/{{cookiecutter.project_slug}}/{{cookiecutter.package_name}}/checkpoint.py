"""The trained agent on disk: what ``evaluate.py`` loads.

A checkpoint names the recipe, the environment and the recipe's hyperparameters next to
the agent's weights, so it can be rebuilt without the run's config file.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from . import recipes
from .config import ConfigError

FINAL = Path("checkpoints") / "final.pt"


def save_agent(path: Path, cfg: DictConfig, agent: torch.nn.Module) -> Path:
    """Write ``agent``'s weights with what rebuilds it; the rename makes the write atomic."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "recipe": cfg.recipe,
        "env_id": cfg.env.id,
        "algo": OmegaConf.to_container(cfg.algo),
        "agent": {key: value.cpu() for key, value in agent.state_dict().items()},
    }
    partial = path.with_suffix(".partial")
    torch.save(state, partial)
    partial.replace(path)
    return path


def locate(path: str) -> Path:
    """A checkpoint file, or a run directory holding ``checkpoints/final.pt``."""
    candidate = Path(path)
    if candidate.is_dir():
        candidate = candidate / FINAL
    if not candidate.is_file():
        raise ConfigError(f"no checkpoint at {candidate}")
    return candidate


def run_dir_of(checkpoint: Path) -> Path:
    return checkpoint.parent.parent if checkpoint.parent.name == FINAL.parent.name else checkpoint.parent


def load(checkpoint: Path) -> tuple[dict[str, Any], ModuleType]:
    """The saved state and its recipe module."""
    try:
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        name = state["recipe"]
    except (OSError, EOFError, pickle.UnpicklingError, RuntimeError, KeyError, TypeError) as error:
        kind = type(error).__name__
        raise ConfigError(
            f"cannot read checkpoint {checkpoint} ({kind}): not an agent train.py saved"
        ) from None
    try:
        return state, recipes.load(name)
    except ValueError as error:
        raise ConfigError(f"checkpoint {checkpoint}: {error}") from None
