"""End-to-end benchmark: collection alongside learning (collector.mode=async) against
collection then learning (sync), for the same frames and the same number of updates.

    python benchmarks/end_to_end.py                      # the first replay recipe's workload below
    python benchmarks/end_to_end.py --frames 20000 algo.updates_per_batch=16

Runs train.py four times: one process with one torch thread (the async collector's process
takes the other core of two), sync then async; then two learners and a replay process,
sync then async, where the cores are already shared (``--learners`` chooses). Compares
training wall time from summary.json. Prints a table and, last, a JSON line.

Each recipe runs the workload in WORKLOADS below: updates that take about as long as the
collection of the batch they follow, where overlapping the two pays most.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT))

from {{ cookiecutter.package_name }} import recipes  # noqa: E402

# Each recipe's workload: its updates take about as long as its collection, on two cores.
{%- set recipes = cookiecutter.recipes.split(",") | map("trim") | list %}
{%- if "dqn" in recipes or "sac" in recipes %}
WORKLOADS = {
{%- if "dqn" in recipes %}
    "dqn": [
        "env.id=CartPole-v1",
        "env.num_envs=32",
        "collector.frames_per_batch=512",
        "algo.updates_per_batch=8",
    ],
{%- endif %}
{%- if "sac" in recipes %}
    "sac": [
        "env.id=Pendulum-v1",
        "env.num_envs=16",
        "collector.frames_per_batch=256",
        "algo.updates_per_batch=6",
    ],
{%- endif %}
}
{%- else %}
WORKLOADS: dict[str, list[str]] = {}
{%- endif %}


def train(learners: int, mode: str, args: argparse.Namespace) -> dict:
    run_dir = PROJECT / "runs" / "benchmarks" / f"end-to-end-{learners}-{mode}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: train.py refuses another run's checkpoints
    # One process gets one torch thread: the async collector's process takes the other core.
    launch = ["fabric.devices=1", "threads=1"] if learners == 1 else [f"fabric.devices={learners}"]
    command = [
        sys.executable,
        "train.py",
        *launch,
        "fabric.accelerator=cpu",
        f"recipe={args.recipe}",
        *WORKLOADS.get(args.recipe, []),
        f"total_frames={args.frames}",
        "eval.episodes=0",
        f"collector.mode={mode}",
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
    parser.add_argument("--recipe", default=replay_recipes[-1], choices=replay_recipes)
    parser.add_argument("--frames", type=int, default=20_000)
    parser.add_argument("--learners", default="1,2", help="layouts to run, e.g. 1 or 1,2")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for train.py")
    args = parser.parse_args()

    header = ("learners", "mode", "train s", "frames/s", "updates/s", "vs sync", "lag")
    print("{:<8} {:<6} {:>8} {:>9} {:>10} {:>8} {:>6}".format(*header))
    figures = {"benchmark": "end_to_end", "recipe": args.recipe, "frames": args.frames}
    for learners in (int(count) for count in args.learners.split(",")):
        sync = train(learners, "sync", args)
        run = train(learners, "async", args)
        if run["updates"] != sync["updates"] or run["frames_collected"] != sync["frames_collected"]:
            sys.exit("error: the two modes did different work; compare like with like")
        for mode, summary in (("sync", sync), ("async", run)):
            ratio = summary["train_s"] / sync["train_s"]
            print(
                f"{learners:<8} {mode:<6} {summary['train_s']:>8.1f} {summary['frames_per_s']:>9.0f} "
                f"{summary['updates_per_s']:>10.1f} {ratio:>8.2f} {summary['policy_lag']:>6.1f}"
            )
        figures[f"{learners}_learners"] = {
            "sync_train_s": sync["train_s"],
            "async_train_s": run["train_s"],
            "async_vs_sync": run["train_s"] / sync["train_s"],
            "sync_updates_per_s": sync["updates_per_s"],
            "async_updates_per_s": run["updates_per_s"],
            "sync_frames_per_s": sync["frames_per_s"],
            "async_frames_per_s": run["frames_per_s"],
            "policy_lag": run["policy_lag"],
        }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
