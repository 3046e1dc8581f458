"""Evaluate a trained agent: greedy episodes, their mean and spread, and optionally videos.

    python evaluate.py checkpoint=runs/try                                # a run directory
    python evaluate.py checkpoint=runs/.../checkpoints/final.pt episodes=20 seed=1
    python evaluate.py checkpoint=runs/try/checkpoints/frames-000000010240   # a training checkpoint
    python evaluate.py checkpoint=runs/try video=true                     # mp4s in run_dir/videos

``evaluate.py`` in the project folder runs ``main`` below; an installed package runs it as
``python -m <package>.evaluate`` or the ``<project>-evaluate`` command.

Prints the mean and standard deviation of the returns and writes them, with every
episode's return, to ``evaluation.json`` in the run's directory.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass

import gymnasium as gym
import torch
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from . import checkpoint, recipes
from .config import ConfigError
from .envs import EnvUnavailable
from .evaluation import evaluate, record

USAGE = (
    "usage: python evaluate.py checkpoint=<run_dir, .pt file or checkpoint folder>"
    " [episodes=10] [seed=0] [video=false]"
)


@dataclass
class EvaluateConfig:
    checkpoint: str = MISSING
    episodes: int = 10
    seed: int = 0
    video: bool = False


def main(argv: list[str] | None = None) -> int:
    """The exit code of an evaluation with command-line arguments ``argv`` (default:
    sys.argv's)."""
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        print(USAGE)
        return 0
    try:
        args = parse(argv)
        path = checkpoint.locate(args.checkpoint)
        state, recipe = checkpoint.load(path)
        # The run's env settings (family preprocessing, vectorization, kwargs), not only its id.
        env = state["env"]
        agent = recipes.make_agent(recipe, state["algo"], env)
        agent.load_state_dict(state["agent"])
        agent.eval()
        run_dir = checkpoint.run_dir_of(path)
        if args.video:
            returns = record(agent.policy, env, args.episodes, args.seed, run_dir / "videos")
        else:
            returns = evaluate(agent.policy, env, args.episodes, args.seed, torch.device("cpu"))
    except (ConfigError, EnvUnavailable) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except gym.error.DependencyNotInstalled as error:
        print(f"error: video=true needs pip install -e '.[video]' ({error})", file=sys.stderr)
        return 2
    result = {
        "checkpoint": str(path),
        "env_id": state["env_id"],
        "episodes": len(returns),
        "seed": args.seed,
        "mean_return": statistics.fmean(returns),
        "std_return": statistics.pstdev(returns),
        "returns": returns,
    }
    output = run_dir / "evaluation.json"
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"return {result['mean_return']:.1f} +- {result['std_return']:.1f} over {len(returns)} episodes")
    if args.video:
        print(f"videos: {run_dir / 'videos'}")
    print(f"evaluation: {output}")
    return 0


def parse(argv: list[str]) -> EvaluateConfig:
    for item in argv:
        if "=" not in item:
            raise ConfigError(f"expected key=value, got {item!r}")
    try:
        args = OmegaConf.merge(OmegaConf.structured(EvaluateConfig), OmegaConf.from_dotlist(argv))
        if OmegaConf.missing_keys(args):
            raise ConfigError(USAGE)
    except OmegaConfBaseException as error:
        raise ConfigError(str(error).splitlines()[0]) from None
    if args.episodes <= 0:
        raise ConfigError(f"episodes must be > 0, got {args.episodes}")
    return OmegaConf.to_object(args)


if __name__ == "__main__":
    sys.exit(main())
