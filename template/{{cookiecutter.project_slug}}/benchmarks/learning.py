"""Learning benchmark: does the recipe reach its target return, in how many frames and seconds?

    python benchmarks/learning.py                      # the default recipe, 2 learners, seeds 1 2 3
    python benchmarks/learning.py --recipe {{ cookiecutter.default_recipe }} --seeds 1 --frames 50000 algo.lr=1e-3
    python benchmarks/learning.py --seeds 1 2 --main-port 29500 -- algo.lr=1e-3   # "--" ends --seeds

Each seed is one `fabric run` on CPU with the recipe's defaults: its env and its frame
budget (``RUN_DEFAULTS``) unless ``--env`` / ``--frames`` say otherwise. The run evaluates
the greedy policy every ``--eval-every`` frames (default: 20 times per run); "reached" is
the first evaluation at or above ``--target`` (default: the recipe's target below, which
is for its default env: another ``--env`` needs its own ``--target``).
Prints a table and, last, one JSON line with every figure and each seed's evaluations.
Two benchmarks at once on one machine need different ``--main-port`` values.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT))

from {{ cookiecutter.package_name }} import config, recipes  # noqa: E402

# Greedy evaluation return each recipe should reach on its default env within its frame budget.
{%- set recipes = cookiecutter.recipes.split(",") | map("trim") | list %}
TARGETS = {
{%- if "dqn" in recipes %}
    "dqn": 475.0,
{%- endif %}
{%- if "ppo" in recipes %}
    "ppo": 475.0,
{%- endif %}
{%- if "r2d2" in recipes %}
    "r2d2": 0.95,  # POPGym's returns: at most 1.0
{%- endif %}
{%- if "sac" in recipes %}
    "sac": -200.0,
{%- endif %}
{%- if "td3" in recipes %}
    "td3": -200.0,
{%- endif %}
}


def run_seed(args: argparse.Namespace, seed: int) -> dict:
    # One folder per learner count: runs on 1 and on N learners, one after the other, keep both.
    name = f"{args.recipe}-{config.one_folder(args.env)}-{args.devices}-learners-seed{seed}"
    run_dir = PROJECT / "runs" / "benchmarks" / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: train.py refuses another run's checkpoints
    fabric = shutil.which("fabric", path=str(Path(sys.executable).parent)) or "fabric"
    command = [
        fabric,
        "run",
        "--accelerator",
        "cpu",
        "--strategy",
        "ddp",
        "--devices",
        str(args.devices),
        "--main-port",
        str(args.main_port),
        "train.py",
        f"recipe={args.recipe}",
        f"env.id={args.env}",
        f"total_frames={args.frames}",
        f"seed={seed}",
        f"eval.every={args.eval_every}",
        f"run_dir={run_dir}",
        *args.overrides,
    ]
    result = subprocess.run(command, cwd=PROJECT, capture_output=True, text=True, env={**os.environ})
    if result.returncode != 0:
        sys.exit(f"error: seed {seed} failed:\n{result.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    reached = next((row for row in summary["eval_history"] if row["eval_return"] >= args.target), None)
    return {
        "seed": seed,
        "reached": reached is not None,
        "frames_to_target": reached["frames"] if reached else None,
        "wall_s_to_target": round(reached["wall_s"], 1) if reached else None,
        "final_eval_return": summary["eval_return"],
        "frames": summary["frames_collected"],
        "wall_s": round(summary["wall_s"], 1),
        "updates_per_s": round(summary["updates_per_s"], 1),
        "curve": {row["frames"]: round(row["eval_return"], 1) for row in summary["eval_history"]},
        "command": " ".join(command[1:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default="{{ cookiecutter.default_recipe }}", choices=recipes.available())
    parser.add_argument("--env")
    parser.add_argument("--frames", type=int)
    parser.add_argument("--target", type=float)
    parser.add_argument("--devices", type=int, default=2, help="learner ranks (replay processes come on top)")
    parser.add_argument("--eval-every", type=int)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument(
        "--main-port", type=int, default=29400, help="fabric run's c10d port; RPC takes the next"
    )
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for train.py")
    args = parser.parse_args()
    defaults = recipes.load(args.recipe).RUN_DEFAULTS
    default_env = defaults["env"]["id"]
    args.env = args.env or default_env
    args.frames = args.frames or defaults["total_frames"]
    args.eval_every = args.eval_every or args.frames // 20
    if args.target is None:
        if args.recipe not in TARGETS:
            parser.error(f"no target return for recipe {args.recipe!r}: pass --target")
        if args.env != default_env:
            parser.error(f"{args.recipe}'s target return is for {default_env}: pass --target for {args.env}")
        args.target = TARGETS[args.recipe]

    rows = []
    header = ("seed", "reached", "frames to target", "s to target", "final return", "wall s")
    print("{:>4} {:>7} {:>16} {:>11} {:>12} {:>7}".format(*header))
    for seed in args.seeds:
        row = run_seed(args, seed)
        rows.append(row)
        print(
            f"{row['seed']:>4} {str(row['reached']):>7} {str(row['frames_to_target']):>16} "
            f"{str(row['wall_s_to_target']):>11} {row['final_eval_return']:>12.1f} {row['wall_s']:>7}",
            flush=True,
        )
    print(
        json.dumps(
            {
                "benchmark": "learning",
                "recipe": args.recipe,
                "env": args.env,
                "target": args.target,
                "frames_budget": args.frames,
                "all_reached": all(row["reached"] for row in rows),
                "seeds": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
