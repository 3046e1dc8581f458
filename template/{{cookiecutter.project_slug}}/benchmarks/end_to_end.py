"""End-to-end benchmark: what a replay rank over RPC costs the learner.

    python benchmarks/end_to_end.py                  # the first replay recipe, 20,000 frames
    python benchmarks/end_to_end.py --frames 50000 algo.batch_size=128

Runs the same configuration twice: one process with the buffer in-process, then one replay
rank plus one learner (`python train.py fabric.devices=2`). Compares their ``updates_per_s``
from summary.json. Prints a table and, last, a JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT))

from {{ cookiecutter.package_name }} import recipes  # noqa: E402


def train(devices: int, args: argparse.Namespace) -> dict:
    run_dir = PROJECT / "runs" / "benchmarks" / f"end-to-end-{devices}"
    command = [
        sys.executable,
        "train.py",
        f"fabric.devices={devices}",
        "fabric.accelerator=cpu",
        f"recipe={args.recipe}",
        f"env.id={args.env}",
        f"total_frames={args.frames}",
        "eval.every=0",
        f"run_dir={run_dir}",
        *args.overrides,
    ]
    result = subprocess.run(command, cwd=PROJECT, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"error: {' '.join(command[1:])} failed:\n{result.stderr[-2000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    replay_recipes = [name for name in recipes.available() if recipes.load(name).Agent.uses_replay]
    if not replay_recipes:
        sys.exit("error: this project has no replay recipe to benchmark")
    parser.add_argument("--recipe", default=replay_recipes[0], choices=replay_recipes)
    parser.add_argument("--env", help="default: the recipe's env")
    parser.add_argument("--frames", type=int, default=20_000)
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for train.py")
    args = parser.parse_args()
    args.env = args.env or recipes.load(args.recipe).RUN_DEFAULTS["env"]["id"]

    single = train(1, args)
    remote = train(2, args)
    ratio = remote["updates_per_s"] / single["updates_per_s"]
    print(f"{'setup':<34} {'updates/s':>10} {'frames/s':>10}")
    for name, summary in (("one process, in-process buffer", single), ("1 replay rank + 1 learner", remote)):
        print(f"{name:<34} {summary['updates_per_s']:>10.1f} {summary['frames_per_s']:>10.1f}")
    print(f"{'ratio (replay rank / in-process)':<34} {ratio:>10.2f}")
    figures = {"benchmark": "end_to_end", "recipe": args.recipe, "env": args.env, "frames": args.frames}
    print(
        json.dumps(
            {
                **figures,
                "in_process_updates_per_s": single["updates_per_s"],
                "replay_rank_updates_per_s": remote["updates_per_s"],
                "ratio": ratio,
            }
        )
    )


if __name__ == "__main__":
    main()
